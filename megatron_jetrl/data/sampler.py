"""Which prompts a step takes: an endless, resumable walk over epochs of a dataset.

Epoch ``e`` visits every index once, in ``torch.randperm`` order drawn from a private
``torch.Generator`` seeded by ``(seed, e)`` (or in order when not shuffling). The walk's whole
state is ``(epoch, position)``, so a sampler restored from ``state_dict()`` returns exactly the
indices the original would have, and the global RNGs are never touched.
"""

from __future__ import annotations

import torch

_STATE_KEYS = ("num_items", "seed", "shuffle", "epoch", "position")


def _epoch_seed(seed: int, epoch: int) -> int:
    return (seed * 1_000_003 + epoch) & (2**63 - 1)


class PromptSampler:
    """``next(n)`` returns the next ``n`` dataset indices, crossing epoch boundaries as needed (a
    batch may hold the end of one epoch and the start of the next). ``epoch`` is the epoch the last
    returned index came from; ``position`` how many of its indices have been returned."""

    def __init__(self, num_items: int, seed: int, shuffle: bool = True):
        if isinstance(num_items, bool) or not isinstance(num_items, int) or num_items < 1:
            raise ValueError(f"num_items must be an integer >= 1; got {num_items!r}")
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise ValueError(f"seed must be an integer; got {seed!r}")
        self.num_items = num_items
        self.seed = seed
        self.shuffle = bool(shuffle)
        self._epoch = 0
        self._position = 0
        self._order = self._permutation(0)

    @property
    def epoch(self) -> int:
        return self._epoch

    @property
    def position(self) -> int:
        return self._position

    def _permutation(self, epoch: int) -> list[int]:
        if not self.shuffle:
            return list(range(self.num_items))
        g = torch.Generator().manual_seed(_epoch_seed(self.seed, epoch))
        return torch.randperm(self.num_items, generator=g).tolist()

    def next(self, n: int) -> list[int]:
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ValueError(f"n must be an integer >= 0; got {n!r}")
        out: list[int] = []
        while len(out) < n:
            if self._position == self.num_items:
                self._epoch += 1
                self._position = 0
                self._order = self._permutation(self._epoch)
            take = min(n - len(out), self.num_items - self._position)
            out.extend(self._order[self._position:self._position + take])
            self._position += take
        return out

    def state_dict(self) -> dict:
        """JSON-serialisable; ``num_items``, ``seed`` and ``shuffle`` are checked on load."""
        return {"num_items": self.num_items, "seed": self.seed, "shuffle": self.shuffle,
                "epoch": self._epoch, "position": self._position}

    def load_state_dict(self, state: dict) -> None:
        missing = [k for k in _STATE_KEYS if k not in state]
        if missing:
            raise ValueError(f"sampler state lacks {missing}; expected the keys {list(_STATE_KEYS)}")
        if state["num_items"] != self.num_items:
            raise ValueError(f"the checkpoint's sampler walked {state['num_items']} prompts but the dataset now has "
                             f"{self.num_items}: the training data (or max_prompt_tokens) changed since the "
                             f"checkpoint; resume with the same data")
        if state["seed"] != self.seed:
            raise ValueError(f"the checkpoint's sampler used seed {state['seed']} but data.seed is {self.seed}; "
                             f"resume with data.seed={state['seed']}")
        if bool(state["shuffle"]) != self.shuffle:
            raise ValueError(f"the checkpoint's sampler used shuffle={bool(state['shuffle'])} but data.shuffle is "
                             f"{self.shuffle}; resume with the same setting")
        epoch, position = state["epoch"], state["position"]
        if isinstance(epoch, bool) or not isinstance(epoch, int) or epoch < 0:
            raise ValueError(f"sampler state epoch must be an integer >= 0; got {epoch!r}")
        if isinstance(position, bool) or not isinstance(position, int) or not 0 <= position <= self.num_items:
            raise ValueError(f"sampler state position must be an integer in [0, {self.num_items}]; got {position!r}")
        self._epoch, self._position = epoch, position
        self._order = self._permutation(epoch)
