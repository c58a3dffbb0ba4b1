// Helpers for the extension's error messages.
//
// Numbers are formatted with std::to_string, never streamed into TORCH_CHECK: on the GPU host
// (torch 2.11) `ostream << int64_t` inside the extension crashed the process instead of raising,
// while strings and dtypes were fine.
#pragma once

#include <ATen/ATen.h>

#include <string>

namespace jetrl {

// A shape or stride list as text: "[4, 256]".
inline std::string dims(at::IntArrayRef d) {
  std::string s = "[";
  for (size_t i = 0; i < d.size(); ++i) s += (i ? ", " : "") + std::to_string(d[i]);
  return s + "]";
}

}  // namespace jetrl
