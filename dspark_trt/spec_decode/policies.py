"""K policy names: the one list every entry point (CLI, Python API, build options, served requests) checks against.

Torch-free, so the tokenizer-only Triton models and the build options can import it. "seed" is accepted as an
alias of "confidence" (the name the DSpark deployment guide uses for that policy); every parser maps it before checking.
"""
from __future__ import annotations

from dspark_trt.errors import InvalidArgumentError

__all__ = ["POLICIES", "POLICY_ALIASES", "PROPOSERS", "resolve_policy_alias", "canonical_policy", "parse_proposers"]

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

PROPOSERS: tuple[str, ...] = ("dspark", "suffix")  # who may propose a request's draft tokens (spec_decode.proposers)


def parse_proposers(spec: str | tuple[str, ...] | list[str]) -> tuple[str, ...]:
    """"dspark,suffix" (or a sequence of names) → the proposer names in PROPOSERS order, deduplicated;
    InvalidArgumentError naming the valid ones otherwise (an empty list too: use the plain policy for none)."""
    names = [n.strip() for n in spec.split(",")] if isinstance(spec, str) else [str(n).strip() for n in spec]
    names = [n for n in names if n]
    bad = [n for n in names if n not in PROPOSERS]
    if bad or not names:
        raise InvalidArgumentError(f"proposers must be a non-empty comma list of {', '.join(PROPOSERS)} (policy "
                                   f"\"plain\" proposes nothing), got {spec!r}")
    return tuple(p for p in PROPOSERS if p in names)
