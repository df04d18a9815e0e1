"""How the sampler picks tokens and when a turn ends."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class SamplingConfig:
    """Token selection and per-turn stopping. Static: a change compiles new sampler functions.

    The order matches Hugging Face's logits warpers: temperature, then top-k, then top-p.
    `temperature=0` is greedy decoding (top_k/top_p are then irrelevant).
    """

    max_new_tokens: int = 256  # per-turn token limit; also the width of the returned buffers
    temperature: float = 1.0  # 0 -> greedy
    top_k: int = 0  # 0 -> off
    top_p: float = 1.0  # 1.0 -> off
    eot_ids: tuple[int, ...] = ()  # end-of-turn ids: a row stops after sampling any of them
    pad_id: int = 0  # written into output slots after a row stopped
    return_raw_logprobs: bool = False  # also return log-probs at the temperature, unfiltered
    # A mixture of experts: also return the experts each sampled token was routed to (off: the
    # decode loop carries none, at real sizes layers x k ids per token of every row).
    return_experts: bool = False

    def __post_init__(self):
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 = off), got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1] (1 = off), got {self.top_p}")
        object.__setattr__(self, "eot_ids", tuple(int(i) for i in self.eot_ids))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
