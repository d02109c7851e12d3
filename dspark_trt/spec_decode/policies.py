"""K policy names: the one list every entry point (CLI, Python API, build options, served requests) checks against.

Torch-free, so the tokenizer-only Triton models and the build options can import it. "seed" is accepted as an
alias of "confidence" (the name the DSpark deployment guide uses for that policy); every parser maps it before checking.
"""
from __future__ import annotations

from dspark_trt.errors import InvalidArgumentError

__all__ = ["POLICIES", "POLICY_ALIASES", "resolve_policy_alias", "canonical_policy"]

POLICIES: tuple[str, ...] = ("plain", "fixed", "confidence", "survival")
POLICY_ALIASES: dict[str, str] = {"seed": "confidence"}


def resolve_policy_alias(name: str) -> str:
    """An alias → its policy name; any other string unchanged (argparse `type=`: `choices` then checks it)."""
    return POLICY_ALIASES.get(name, name)


def canonical_policy(name: str) -> str:
    """A policy name or alias → the policy name; InvalidArgumentError naming the valid ones otherwise."""
    policy = resolve_policy_alias(name)
    if policy not in POLICIES:
        raise InvalidArgumentError(f"policy must be one of {', '.join(POLICIES)} (\"seed\" = \"confidence\"), "
                                   f"got {name!r}")
    return policy
