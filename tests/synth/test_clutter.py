"""add_clutter's draws pinned: the same generator state gives the same clutter, draw for draw.

The digest below was taken before add_clutter was split into steps (one function of 179 lines); a
change in the order or the arguments of any random draw, or in what a draw places, changes it. The
synthetic datasets are byte-identical across versions only while this holds.
"""

from __future__ import annotations

import hashlib

import numpy as np

from pfactory.synth.clutter import add_clutter
from pfactory.synth.layout import GROUND_Z, sample_layout
from pfactory.synth.occupancy import Occupancy
from pfactory.synth.raycast import PrimitiveBuilder

KINDS = ("facade", "tree", "bush", "hedge", "wall", "pole", "post", "bin", "bollard", "cone")
# Streets of seeds 0..11, "front" and "around" stretches (as scene.sample_scene asks for them).
PINNED = "036270f7554759f5dba32460a5024ef28c72ebeae63d891a620255e83941632e"


def _clutter_digest(seeds: range) -> tuple[str, dict[str, int]]:
    """sha256 over every street's primitives (floats rounded to 1e-6, so a last-bit libm difference
    does not count), occupancy rows, counts and the generator's next 8 bytes (how much was drawn);
    returns it with the counts summed over all streets."""
    h = hashlib.sha256()
    total = dict.fromkeys(KINDS, 0)
    for seed in seeds:
        for s_lo, s_hi in ((-60.0, 110.0), (-110.0, 110.0)):
            rng = np.random.default_rng(seed)
            layout = sample_layout(rng)
            b, occ = PrimitiveBuilder(), Occupancy()
            occ.add(-0.5, 0.0, 4.8, 2.0, 0.0, GROUND_Z, 0.0)
            counts = add_clutter(rng, layout, b, occ, s_lo, s_hi)
            p = b.build()
            for ints in (p.kind, p.owner, p.material):
                h.update(np.ascontiguousarray(ints, dtype=np.int64).tobytes())
            for floats in (p.params, p.color, p.reflectance, p.taper, np.array(occ.rows)):
                h.update(np.round(np.asarray(floats, dtype=np.float64), 6).tobytes())
            h.update(repr(sorted(counts.items())).encode())
            h.update(rng.bytes(8))
            for k, v in counts.items():
                total[k] += v
    return h.hexdigest(), total


def test_clutter_draws_are_pinned():
    digest, total = _clutter_digest(range(12))
    # Every kind of clutter is placed somewhere, so the digest covers every branch's draws.
    assert all(total[k] > 0 for k in KINDS), total
    assert digest == PINNED


def test_clutter_depends_on_the_generator():
    assert _clutter_digest(range(1))[0] != _clutter_digest(range(1, 2))[0]
