"""A few optimizer steps of a small MLP whose linears run FProp, DGrad and WGrad in FP8.

Shows the two promises of the precision package on whatever device you have (CPU: emulated GEMM,
Hopper: torch's blockwise scaled_mm): the loss goes down like the BF16 model's, and the FP8 weight
bytes the forward used equal the reference quantizer's bytes of the current weight, which is what
the rollout engine will be handed.

    python examples/fp8_linear.py [--steps 20]
"""

import argparse
import hashlib

import torch

from megatron_jetrl.precision import Fp8Linear, PrecisionRecipe, ReferenceQuantizer, quantize_fp8_blockwise


def digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.contiguous().view(torch.uint8).cpu().numpy().tobytes()).hexdigest()[:16]


def make_quantizer(recipe: PrecisionRecipe):
    try:
        from megatron_jetrl.ops import NativeQuantizer

        return NativeQuantizer(pow2_scales=recipe.fp8.pow2_scales, eps=recipe.fp8.amax_epsilon)
    except RuntimeError as e:  # extension not built: the pure-torch reference gives the same bytes
        print(f"using ReferenceQuantizer ({e})")
        return ReferenceQuantizer(pow2_scales=recipe.fp8.pow2_scales, eps=recipe.fp8.amax_epsilon)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    recipe = PrecisionRecipe()
    quantizer = make_quantizer(recipe)
    torch.manual_seed(0)
    x = torch.randn(512, 256, device=device, dtype=torch.bfloat16)
    target = torch.randn(512, 128, device=device, dtype=torch.bfloat16)

    def mlp(fp8: bool) -> torch.nn.Module:
        torch.manual_seed(1)
        if fp8:
            layers = [Fp8Linear(256, 512, quantizer=quantizer, device=device), torch.nn.GELU(),
                      Fp8Linear(512, 128, quantizer=quantizer, device=device)]
        else:
            layers = [torch.nn.Linear(256, 512, bias=False, device=device), torch.nn.GELU(),
                      torch.nn.Linear(512, 128, bias=False, device=device)]
        return torch.nn.Sequential(*layers).to(torch.bfloat16)

    for name, model in (("bf16", mlp(False)), ("fp8", mlp(True))):
        opt = torch.optim.Adam(model.parameters(), lr=1e-3)
        losses = []
        for _ in range(args.steps):
            loss = torch.nn.functional.mse_loss(model(x).float(), target.float())
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())
        print(f"{name}: loss {losses[0]:.4f} -> {losses[-1]:.4f} over {args.steps} steps on {device}")
        if name == "fp8":
            layer = model[0]
            used = layer.cache.get(layer.weight, quantizer).fprop
            data, scale_inv = quantize_fp8_blockwise(layer.weight.detach(), (128, 128))
            same = digest(used.data) == digest(data) and digest(used.scale_inv) == digest(scale_inv)
            print(f"fp8: forward weight bytes {digest(used.data)} == reference {digest(data)}: {same}")


if __name__ == "__main__":
    main()
