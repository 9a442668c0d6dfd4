"""Every built-in score mod of the positional-scheme registry, built by its scheme.

The tests of score mods inside the attention implementations
(tests/test_score_mod.py against float64, tests/test_pallas_score_mod.py in
the kernels and their lowering) and `python benchmarks/score_mod.py` take their mods
from `builtin_mods`, not from a hand list, so a scheme registered in
`jattn.models.SCHEMES` whose `score_mod` hook returns a `jattn.ScoreMod` is
covered with no edit. Each scheme's own hooks (`stack_state`, `score_mod`)
run in a small flax module, once in a causal and once in a bidirectional
layer, at the config's defaults and at each of the scheme's `SETTINGS`:
its parameters come from its own initialisers, with a seed from its name
(`seed_of`), so adding a scheme changes no other scheme's draws.

A setting is a dict of `TransformerConfig` fields. A scheme needs one where
its defaults give no score mod or leave a form untested (Shaw's bias term
is off by default; ALiBi's "offset" form is a config choice); `SETTINGS` is
public so a test or a benchmark can read which settings are covered.

Initial tables can be all zeros (Shaw's bias starts at 0), which would hide
a wrong lookup in the forward, so every raw parameter is moved by a seeded
N(0, PERTURB^2) before the hook maps it to the mod's parameters (KERPLE's
softplus keeps its coefficients positive).
"""

from __future__ import annotations

import dataclasses
import functools
import zlib
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from jattn.models import SCHEMES, TransformerConfig
from jattn.models.schemes import Site
from jattn.score_mod import ScoreMod

# The scheme's own options (its `Options` fields) each scheme's score mod is built at,
# in place of its defaults alone ({}).
SETTINGS: dict[str, tuple[dict, ...]] = {
    "shaw": ({"terms": "key+value+bias"},),  # the bias term is the score mod
    "alibi": ({}, {"mode": "offset"}),  # bidirectional layers: both forms
    # Linear memory holds for a fixed clip (issue 35); the default clip is the
    # longest row (max_len - 1), where Shaw's per-query table is O(L * max_len).
    "transformer_xl": ({"max_distance": 16},),
}
PERTURB = 0.5


def seed_of(name: str) -> int:
    """A scheme's seed: a stable hash of its name, not its place in the registry."""
    return zlib.crc32(name.encode())


def settings_of(name: str) -> tuple[dict, ...]:
    """The settings a scheme's score mod is built at (`({},)` unless `SETTINGS` says)."""
    return SETTINGS.get(name, ({},))


def setting_fields(name: str, setting: dict) -> dict:
    """The `TransformerConfig` fields of scheme `name`'s `setting` (its own
    options, under `position_options` by its options key)."""
    return {"position_options": {SCHEMES[name].options_key: setting}} if setting else {}


@dataclasses.dataclass(frozen=True)
class BuiltinMod:
    """One score mod of the registry.

    Attributes:
      scheme: the registered name whose hook built it.
      mod: the `jattn.ScoreMod`, float32 parameters.
    """

    scheme: str
    mod: ScoreMod

    @property
    def shift_invariant(self) -> bool:
        """The scheme's own declaration (FIRE reads the query position itself)."""
        return SCHEMES[self.scheme].shift_invariant


class _Layer(nn.Module):
    """Hosts one scheme's hooks, as an attention layer and its stack do."""

    config: Any
    causal: bool

    @nn.compact
    def __call__(self) -> ScoreMod | None:
        cfg, site = self.config, Site(causal=self.causal)
        scheme = SCHEMES[cfg.position]
        state = scheme.stack_state(self, cfg, causal=self.causal)
        if hasattr(scheme, "shift_queries"):  # the hooks before score_mod, in the layer's order
            scheme.shift_queries(self, cfg, site, jnp.zeros((1, 1, cfg.num_heads, cfg.head_dim)))
        return scheme.score_mod(self, cfg, site, state)


def scheme_mod(config: TransformerConfig, *, causal: bool, seed: int) -> ScoreMod | None:
    """The score mod of `config.position` in one layer, parameters drawn by its
    initialisers and moved as the module docstring says (None: the scheme has none)."""
    return _build(config, causal, jax.random.key(seed))


@functools.partial(jax.jit, static_argnums=(0, 1))
def _build(config: TransformerConfig, causal: bool, key: jax.Array) -> ScoreMod | None:
    """`scheme_mod` as one compiled program (a ScoreMod is a pytree: `fn` is static)."""
    layer = _Layer(config, causal)
    init_key, move_key = jax.random.split(key)
    leaves, tree = jax.tree.flatten(layer.init(init_key))
    moved = [
        x + PERTURB * jax.random.normal(jax.random.fold_in(move_key, i), jnp.shape(x))
        for i, x in enumerate(leaves)
    ]
    mod = layer.apply(jax.tree.unflatten(tree, moved))
    if mod is None:
        return None
    # replace, not ScoreMod(fn, params): a distance-table mod keeps its distance form.
    return dataclasses.replace(
        mod, params=jax.tree.map(lambda x: x.astype(jnp.float32), mod.params)
    )


def _same_code(a: ScoreMod, b: ScoreMod) -> bool:
    """Same function, name and parameter shapes: the same compiled path."""
    shapes = lambda m: jax.tree.map(np.shape, m.params)  # noqa: E731
    same_tree = jax.tree.structure(a.params) == jax.tree.structure(b.params)
    return a.fn is b.fn and a.name == b.name and same_tree and shapes(a) == shapes(b)


def _label(name: str, setting: dict) -> str:
    return name + "".join(f"[{k}={v}]" for k, v in sorted(setting.items()))


def builtin_mods(*, sites: tuple[bool, ...] = (True, False), **fields) -> dict[str, BuiltinMod]:
    """Every score mod the built-in schemes (those defined in `jattn`) build, without repeats.

    Args:
      sites: which layers to build in: True causal, False bidirectional.
      **fields: `TransformerConfig` fields of the small model (num_heads,
        position_options, ...); `vocab_size` and `d_model` default to 8 and
        8 * num_heads.

    Returns:
      label -> `BuiltinMod`, labels `scheme[setting]`, with `/causal` or
      `/bidirectional` appended where the two layers' mods differ. A mod that
      runs the same code as one listed before (same fn, name and parameter
      shapes: KERPLE in both layers, ALiBi's causal form under "offset") is
      left out.
    """
    fields = {"vocab_size": 8, **fields}
    fields.setdefault("d_model", 8 * fields.get("num_heads", 8))
    found: dict[str, BuiltinMod] = {}
    for name in sorted(n for n, s in SCHEMES.items() if type(s).__module__.startswith("jattn.")):
        for setting in settings_of(name):
            config = TransformerConfig(**{**fields, "position": name})
            config = config.replace(**setting_fields(name, setting))
            per_site = {}
            for causal in sites:
                mod = scheme_mod(config, causal=causal, seed=seed_of(name))
                if mod is None or any(_same_code(mod, m) for m in per_site.values()):
                    continue
                per_site["/causal" if causal else "/bidirectional"] = mod
            for suffix, mod in per_site.items():
                if any(_same_code(mod, b.mod) for b in found.values()):
                    continue
                label = _label(name, setting) + (suffix if len(per_site) > 1 else "")
                found[label] = BuiltinMod(name, mod)
    return found


# The tests' small model: 4 heads; tables of 12 T5 buckets and 2k + 1 = 9 Shaw
# distances (not powers of two, so Triton gets them flattened and padded); FIRE
# with 8 hidden units (a power of two: its kernel form is used); max_len 8, so
# a table sized by the longest row stays small (2 * 8 - 1 entries).
SMALL = dict(
    num_heads=4,
    max_len=8,
    position_options={
        "t5": {"num_buckets": 12, "max_distance": 20},
        "shaw": {"max_distance": 4},
        "fire": {"hidden": 8},
    },
)


@functools.cache
def small_mods() -> dict[str, BuiltinMod]:
    """`builtin_mods` of the tests' small model, built once per process."""
    return builtin_mods(**SMALL)


def label_of(mod_name: str, site: str = "") -> str:
    """The label of the first small mod named `mod_name` (`ScoreMod.name`), in
    `site` ("causal" or "bidirectional") when given: for the tests that need
    one particular mod (T5's bidirectional table, ALiBi's offset form)."""
    for label, built in small_mods().items():
        if built.mod.name == mod_name and label.endswith(site):
            return label
    raise KeyError(f"no built-in score mod named {mod_name!r} {site}".rstrip())
