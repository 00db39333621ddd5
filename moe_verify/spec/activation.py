"""The gated activation between the two GEMMs: silu or swigluoai, with an optional clamp."""

from __future__ import annotations

from dataclasses import dataclass

from moe_verify.spec.checks import _got, check_float


@dataclass(frozen=True)
class Activation:
    """Gated activation on [gate | up] halves of GEMM1's output (gate = first half).

    silu:      y = silu(g) * u
    swigluoai: y = (u + beta) * g * sigmoid(alpha * g)
    With `limit`, the gate is clamped from above only and up on both sides, before the activation.
    """

    kind: str = "silu"
    alpha: float = 1.0
    beta: float = 0.0
    limit: float | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.kind, str):
            raise TypeError(
                f"Activation.kind: expected 'silu' or 'swigluoai', got {_got(self.kind)}"
            )
        if self.kind not in ("silu", "swigluoai"):
            raise ValueError(f"Activation.kind: expected 'silu' or 'swigluoai', got {self.kind!r}")
        object.__setattr__(self, "alpha", check_float("Activation.alpha", self.alpha))
        object.__setattr__(self, "beta", check_float("Activation.beta", self.beta))
        if self.limit is not None:
            limit = check_float("Activation.limit (the clamp)", self.limit, positive=True)
            object.__setattr__(self, "limit", limit)
        if self.kind == "silu" and (self.alpha != 1.0 or self.beta != 0.0):
            raise ValueError(
                f"Activation: silu has alpha=1, beta=0; got alpha={self.alpha}, beta={self.beta} "
                "(use kind='swigluoai')"
            )

    @property
    def tag(self) -> str:
        if self.kind == "silu" and self.limit is None:
            return "silu"
        parts = [self.kind]
        if self.kind == "swigluoai":
            parts.append(f"a{self.alpha:g}b{self.beta:g}")
        if self.limit is not None:
            parts.append(f"L{self.limit:g}")
        return "-".join(parts)

    @staticmethod
    def parse(text: str) -> Activation:
        """'silu', 'silu:L7', 'swigluoai', 'swigluoai:1.702:1.0:7.0' (alpha:beta:limit)."""
        syntax = "'silu[:L<limit>]' or 'swigluoai[:alpha[:beta[:limit]]]'"
        if not isinstance(text, str):
            raise TypeError(f"activation: expected a string {syntax}, got {_got(text)}")
        kind, _, rest = text.partition(":")
        args = [a for a in rest.split(":") if a] if rest else []
        if kind == "silu":
            if len(args) > 1 or (args and not args[0].startswith("L")):
                raise ValueError(f"activation {text!r}: silu takes only a limit, as 'silu:L7'")
            return Activation(
                "silu", limit=_parse_number(text, "limit", args[0][1:]) if args else None
            )
        if kind == "swigluoai":
            if len(args) > 3:
                raise ValueError(
                    f"activation {text!r}: swigluoai takes at most alpha:beta:limit, got "
                    f"{len(args)} values"
                )
            names = ("alpha", "beta", "limit")
            vals = [_parse_number(text, n, a) for n, a in zip(names, args, strict=False)]
            alpha, beta, limit = (vals + [1.702, 1.0, 7.0][len(vals) :])[:3]
            return Activation("swigluoai", alpha, beta, limit)
        raise ValueError(f"activation {text!r}: expected {syntax}")


def _parse_number(text: str, name: str, value: str) -> float:
    try:
        return float(value)
    except ValueError:
        raise ValueError(f"activation {text!r}: {name}: expected a number, got {value!r}") from None
