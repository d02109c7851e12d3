"""K policy names: the one list every entry point (CLI, Python API, build options, served requests) checks against.

Torch-free, so the tokenizer-only Triton models and the build options can import it. "seed" is accepted as an
alias of "confidence" (the name the DSpark deployment guide uses for that policy); every parser maps it before checking.
"""
from __future__ import annotations

from dspark_trt.errors import InvalidArgumentError

__all__ = ["DEFAULT_PROPOSERS", "SEEDED_PROPOSERS", "default_proposers", "POLICIES", "POLICY_ALIASES", "PROPOSERS",
           "resolve_policy_alias", "canonical_policy", "parse_proposers"]

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
# The product's default for greedy requests and unseeded sampled ones: both, chosen per row and round by expected
# committed tokens against the cost (quiet dspark-trt bench, Sapphire Rapids, 30 prompts: amx hybrid 1.31× plain vs
# DSpark alone 1.04×; avx2 engine 1.12× vs 0.97×; output = plain greedy in every row). A request or server may name
# either alone.
DEFAULT_PROPOSERS: tuple[str, ...] = ("dspark", "suffix")
# ... and for a sampled request that names its seed: the suffix match alone, whose rounds are verified coupled to
# the target's sampler, so the request commits plain sampling's tokens for its seed at any K and load (a DSpark round
# draws other tokens). Measured (dspark-trt bench --temperature 0.7, Zen 4, 18 held-out prompts): suffix 1.18× plain.
SEEDED_PROPOSERS: tuple[str, ...] = ("suffix",)


def default_proposers(temperature: float = 0.0, seed: int | None = None) -> tuple[str, ...]:
    """The proposers of a request that names none: both for greedy requests and for sampled ones without a seed; the
    suffix match alone for a sampled request with a seed (spec_decode.accept.sample_accept verifies a suffix proposal
    coupled to the target's own sampler: such a request commits, token for token, what plain sampling with its seed
    commits — at any load, whatever the match drew on)."""
    return SEEDED_PROPOSERS if temperature > 0 and seed is not None else DEFAULT_PROPOSERS


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
