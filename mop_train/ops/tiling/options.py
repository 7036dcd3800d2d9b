"""The tile sizes a run uses, resolved once from `[mop.tiling]` (the config layer is not imported here).

    tiling = TilingOptions.resolve("auto", 0, tokens=N, ffn_token_bytes=..., block_token_bytes=...)
    tiling.ffn_tokens, tiling.block_tokens          # ints: 0 = untiled

Legend: N tokens a rank holds per micro-batch (B * S / D).
"""

from __future__ import annotations

from dataclasses import dataclass

from mop_train.ops.tiling.memory import auto_tile_tokens


@dataclass(frozen=True)
class TilingOptions:
    """Tokens per tile of the FFNs (dense and shared) and of attention's row-wise stages; 0 = untiled."""

    ffn_tokens: int = 0
    block_tokens: int = 0

    def __post_init__(self):
        for key in ("ffn_tokens", "block_tokens"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"mop.tiling.{key} = {value!r} must be 0 (untiled), a token count >= 1 or "
                                 f"\"auto\" (resolve it with TilingOptions.resolve)")

    @classmethod
    def resolve(cls, ffn_tokens: int | str, block_tokens: int | str, *, tokens: int, ffn_token_bytes: int,
                block_token_bytes: int) -> TilingOptions:
        """Resolve "auto" entries with `memory.auto_tile_tokens` for `tokens` per rank, given the tiled
        stage's working bytes per token in backward (`memory.ffn_tile_token_bytes`, ...)."""
        def one(value, per_token):
            if isinstance(value, str):
                if value.strip().lower() != "auto":
                    raise ValueError(f"mop.tiling tile = {value!r}: expected 0, a token count or \"auto\"")
                return auto_tile_tokens(per_token, tokens)
            return value

        return cls(one(ffn_tokens, ffn_token_bytes), one(block_tokens, block_token_bytes))

    def label(self) -> str:
        parts = [f"{name} {value:,} tokens" for name, value in (("FFN", self.ffn_tokens),
                                                                ("attention stages", self.block_tokens)) if value]
        return "tiled " + ", ".join(parts) if parts else "untiled"
