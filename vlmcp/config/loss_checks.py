"""The `loss` section's rules: which option applies to which objective, the settings an option
requires, and the terms of a several-term loss.

An option a job sets (in the file or with ``--set``) that does not apply to its `loss.type` (or
to a term's type) is an error naming the key, as is a setting an option requires and the job
leaves out. Defaults of options that do not apply are never read.
"""

from __future__ import annotations

from dataclasses import fields
from typing import Any

from vlmcp.config.checks import build_section
from vlmcp.config.schema import PAIR_OBJECTIVES, TOKEN_OBJECTIVES, LossSection, LossTerm
from vlmcp.errors import ConfigError

#: The token objectives that are policy-gradient objectives (the mismatch correction applies).
POLICY_OBJECTIVES = ("policy_gradient", "ppo_clip", "dppo", "gspo", "cispo", "opd")
_CLIPPED = ("ppo_clip", "gspo", "cispo")
_MISMATCH_OPTIONS = ("mismatch_level", "mismatch_reduce", "mismatch_cap", "mismatch_low",
                     "mismatch_high")

#: Option -> the loss types it applies to (options not listed apply to every type).
APPLIES_TO: dict[str, tuple[str, ...]] = {
    "normalize": TOKEN_OBJECTIVES,
    "normalize_constant": TOKEN_OBJECTIVES,
    "weights": TOKEN_OBJECTIVES,
    "clip_low": _CLIPPED,
    "clip_high": _CLIPPED,
    "clip_ratio_c": ("ppo_clip",),
    "kl_coef": ("ppo_clip",),
    "delta_low": ("dppo",),
    "delta_high": ("dppo",),
    "kl_tau": ("dppo",),
    "opd_form": ("opd",),
    "mismatch": POLICY_OBJECTIVES,
    **{name: POLICY_OBJECTIVES for name in _MISMATCH_OPTIONS},
    "beta": PAIR_OBJECTIVES,
    "gamma": ("simpo",),
    "reference_logps": ("dpo", "ipo"),
}

#: Mismatch option -> the `loss.mismatch` values it belongs to.
_MISMATCH_KIND = {"mismatch_level": ("tis", "mis"), "mismatch_reduce": ("tis", "mis"),
                  "mismatch_cap": ("tis",), "mismatch_low": ("mis",), "mismatch_high": ("mis",)}


def term_problems(term: LossTerm, given: set[str], prefix: str) -> list[str]:
    """Problems of one objective whose keys `given` (names) the job sets; keys are named
    `prefix` + name ("loss." or "loss.terms[1].")."""
    problems = []
    for name in sorted(given):
        types = APPLIES_TO.get(name)
        if types is not None and term.type not in types:
            problems.append(f"config key '{prefix}{name}' does not apply to {prefix}type "
                            f"{term.type!r} (it applies to {', '.join(types)})")
    if term.type not in TOKEN_OBJECTIVES:
        return problems
    if term.normalize == "constant" and term.normalize_constant is None:
        problems.append(f"config key '{prefix}normalize_constant' is required by "
                        f"{prefix}normalize \"constant\"")
    if term.normalize != "constant" and "normalize_constant" in given:
        problems.append(f"config key '{prefix}normalize_constant' is set but {prefix}normalize "
                        f"is {term.normalize!r} (it applies to \"constant\")")
    if term.weights is not None and not term.weights.endswith("_weights"):
        problems.append(f"config key '{prefix}weights': {term.weights!r} is not a weight array "
                        "name (it must end in \"_weights\", e.g. \"loss_weights\")")
    if term.clip_ratio_c is not None and term.clip_ratio_c <= 1.0:
        problems.append(f"config key '{prefix}clip_ratio_c': must be > 1, got "
                        f"{term.clip_ratio_c}")
    for name, kinds in _MISMATCH_KIND.items():
        if name in given and term.mismatch not in kinds:
            problems.append(f"config key '{prefix}{name}' is set but {prefix}mismatch is "
                            f"{term.mismatch!r} (it applies to {' and '.join(kinds)})")
    if "mismatch_reduce" in given and term.mismatch_level != "sequence":
        problems.append(f"config key '{prefix}mismatch_reduce' is set but "
                        f"{prefix}mismatch_level is {term.mismatch_level!r} (it applies to "
                        "\"sequence\")")
    if term.mismatch != "none" and term.type == "dppo":
        problems.append(f"config key '{prefix}mismatch': {prefix}type \"dppo\" takes its ratio "
                        "against inference_logprobs already (pi / mu); a mismatch correction "
                        "would weight by pi_old / mu a second time (leave it \"none\")")
    if term.mismatch != "none" and term.opd_form == "importance":
        problems.append(f"config key '{prefix}mismatch': {prefix}opd_form \"importance\" "
                        "weights by pi / mu already; a mismatch correction would weight by "
                        "pi_old / mu a second time (leave it \"none\")")
    if term.mismatch == "mis" and term.mismatch_low > term.mismatch_high:
        problems.append(f"config key '{prefix}mismatch_low' ({term.mismatch_low}) is above "
                        f"{prefix}mismatch_high ({term.mismatch_high})")
    return problems


def loss_warnings(loss: LossSection, explicit: frozenset[str]) -> list[str]:
    """Settings of a checked `loss` section that vlmcp honours but that depart from the
    objective's paper, one line each naming the key (`explicit`: the job's set key paths)."""
    given = {key.removeprefix("loss.") for key in explicit if key.startswith("loss.")}
    named = ([(loss, "loss.", given)] if not loss.terms else
             [(term, f"loss.terms[{k}].", set(raw)) for k, (term, raw)
              in enumerate(zip(loss_terms(loss), loss.terms))])
    return [f"config key '{prefix}normalize': \"token\" with {prefix}type \"gspo\" divides by "
            "the step's target count, so long samples weigh more; the GSPO paper takes each "
            "sample's mean (\"sequence\", gspo's default)"
            for term, prefix, keys in named
            if term.type == "gspo" and term.normalize == "token" and "normalize" in keys]


def loss_problems(loss: LossSection, explicit: frozenset[str]) -> list[str]:
    """The rules of the `loss` section whose set keys are `explicit` (full key paths)."""
    given = {key.removeprefix("loss.") for key in explicit if key.startswith("loss.")}
    if not loss.terms:
        return term_problems(loss, given - {"terms"}, "loss.")
    problems = [f"config key 'loss.{name}' is set besides 'loss.terms' (each term sets its own "
                "keys)" for name in sorted(given - {"terms"})]
    for k, raw in enumerate(loss.terms):
        prefix = f"loss.terms[{k}]."
        term, found = build_term(raw, prefix)
        problems += found
        if term is None:
            continue
        if term.type in PAIR_OBJECTIVES:
            problems.append(f"config key '{prefix}type': {term.type!r} is a preference "
                            "objective, the whole loss of its job; it cannot be a term")
            continue
        problems += term_problems(term, set(raw), prefix)
    return problems


def build_term(raw: Any, prefix: str) -> tuple[LossTerm | None, list[str]]:
    """A `LossTerm` from one raw `loss.terms` entry, and its schema problems (None on any)."""
    problems: list[str] = []
    if not isinstance(raw, dict):
        return None, [f"config key '{prefix.rstrip('.')}': expected an object, got {raw!r}"]
    term = build_section(LossTerm, raw, prefix, problems)
    return (None if problems else term), problems


def loss_terms(loss: LossSection) -> list[LossTerm]:
    """The objectives of a checked `loss` section: its terms, else the section itself."""
    if not loss.terms:
        return [LossTerm(**{f.name: getattr(loss, f.name) for f in fields(LossTerm)})]
    terms = []
    for k, raw in enumerate(loss.terms):
        term, problems = build_term(raw, f"loss.terms[{k}].")
        if term is None:
            raise ConfigError(problems)
        terms.append(term)
    return terms
