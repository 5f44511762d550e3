"""research/data/mixture.py: the --mix specs and their refusals, the dynamic rule against a float64 loop written from
the paper's Algorithm 1, the sampler's proportions within sampling error of its weights, each row read from its
source's own loader, and a sampler rebuilt from its saved state reading the same batches."""

import math

import numpy as np
import pytest

from research.data import DataError
from research.data.loader import Loader
from research.data.mixture import Mixture, dynamic_update, parse_mix

NAMES = ("code", "docs", "text")


def loaders(rows=None, B=16, L=8):
  rng = np.random.default_rng(0)
  # three token streams with disjoint values, so a row's source is readable from its tokens
  streams = [rng.integers(100 * i, 100 * i + 100, 5000).astype(np.uint16) for i in range(3)]
  return {n: Loader(t, batch_size=B, seq_len=L, seed=1, sampling="random", rows=rows, workers=0)
          for n, t in zip(NAMES, streams)}


def test_specs_parse_and_bad_ones_are_refused_in_one_line():
  assert parse_mix("uniform", NAMES).initial({}).tolist() == [1 / 3] * 3
  np.testing.assert_allclose(parse_mix("size", NAMES).initial({"code": 1, "docs": 1, "text": 2}), [0.25, 0.25, 0.5])
  np.testing.assert_allclose(parse_mix("fixed:2,1,1", NAMES).initial({}), [0.5, 0.25, 0.25])
  d = parse_mix("dynamic:eta=5,c=0.2,every=50", NAMES)
  assert (d.rule, d.eta, d.c, d.every, d.batches) == ("dynamic", 5.0, 0.2, 50, 5)
  assert parse_mix("dynamic", NAMES) == parse_mix("dynamic:eta=10,c=0.05,every=100,batches=5", NAMES)
  for bad, message in [("mixed", "must be one of"), ("fixed:1,2", "give 3 non-negative"), ("fixed:1,-1,1", "give 3"),
                       ("fixed:0,0,0", "not all 0"), ("fixed:a,b,c", "must be numbers"), ("uniform:1", "no arguments"),
                       ("dynamic:eta=x", "not a number"), ("dynamic:temp=1", "dynamic takes"),
                       ("dynamic:c=2", "0 <= c <= 1"), ("dynamic:every=0", "every >= 1")]:
    with pytest.raises(DataError, match=message) as e:
      parse_mix(bad, NAMES)
    assert "\n" not in str(e.value)
  with pytest.raises(DataError, match="at least 3 sources"):  # two sources: Δ_1 = Δ_2, the weights cannot move
    parse_mix("dynamic", NAMES[:2])
  np.testing.assert_allclose(dynamic_update([0.5, 0.5], [[1, 3], [4, 0]]), [0.5, 0.5])


def reference_update(w, loads, eta, c):
  """Algorithm 1, element by element, in float64."""
  n = len(w)
  o = [[x / sum(row) for x in row] for row in loads]
  delta = [sum(math.sqrt(sum((o[i][k] - o[j][k]) ** 2 for k in range(len(o[i])))) for j in range(n)) / n
           for i in range(n)]
  z = [math.log(w[i]) + eta * delta[i] for i in range(n)]
  alpha = [math.exp(v) / sum(math.exp(u) for u in z) for v in z]
  smoothed = [(1 - c) * a + c / n for a in alpha]
  return [v / sum(smoothed) for v in smoothed]


def test_the_dynamic_rule_is_algorithm_1():
  rng = np.random.default_rng(3)
  for _ in range(5):
    w = rng.dirichlet(np.ones(4))
    loads = rng.integers(1, 50, (4, 8)).astype(float)  # token counts per expert
    np.testing.assert_allclose(dynamic_update(w, loads, 10.0, 0.05), reference_update(w, loads.tolist(), 10.0, 0.05),
                               rtol=1e-12)
  w = np.array([0.5, 0.3, 0.2])
  same = np.ones((3, 8))  # equal routing: Δ equal, α = w, only the smoothing moves it
  np.testing.assert_allclose(dynamic_update(w, same, 10.0, 0.05), 0.95 * w + 0.05 / 3, rtol=1e-12)
  apart = np.array([[1, 1, 1, 1], [1, 1, 1, 1], [4, 0, 0, 0]], float)  # the third routes differently
  new = dynamic_update(np.ones(3) / 3, apart, 10.0, 0.05)
  assert new[2] > 1 / 3 > new[0] == pytest.approx(new[1])


def test_rows_follow_the_weights_within_sampling_error_and_come_from_their_source():
  mix = Mixture(loaders(), seed=7, weights=[0.5, 0.3, 0.2])
  counts = np.zeros(3)
  for t in range(300):
    x, y, src = mix.batch(t)
    counts += np.bincount(src, minlength=3)
    assert ((x // 100) == src[:, None]).all() and ((y // 100) == src[:, None]).all()  # tokens of their own stream
    if t < 3:
      for c in range(3):  # row r of a source-c row is row r of source c's own batch of the step
        own = mix.loaders[c].batch(t)[0]
        np.testing.assert_array_equal(x[src == c], own[src == c])
  n = 300 * 16
  for share, w in zip(counts / n, (0.5, 0.3, 0.2)):
    assert abs(share - w) < 4 * math.sqrt(w * (1 - w) / n), (counts / n)


def test_changed_weights_apply_from_their_step_and_a_rebuilt_sampler_reads_the_same_batches():
  mix = Mixture(loaders(), seed=7, weights=[1, 1, 1])
  before = [mix.batch(t) for t in range(12)]
  mix.set_weights(6, [0.0, 0.0, 1.0])
  for t in range(6):  # earlier steps keep the weights they were drawn with
    np.testing.assert_array_equal(mix.batch(t)[0], before[t][0])
  assert all((mix.batch(t)[2] == 2).all() for t in range(6, 12))
  again = Mixture(loaders(), seed=7, weights=[1, 1, 1], segments=mix.state()["segments"])
  for t in range(12):
    for a, b in zip(again.batch(t), mix.batch(t)):
      np.testing.assert_array_equal(a, b)
  mix.set_weights(3, [1, 0, 0])  # a rewind drops the later segment
  assert [s for s, _ in mix.segments] == [0, 3]


def test_a_process_reads_its_own_rows_of_the_global_batch():
  whole = Mixture(loaders(), seed=7, weights=[0.2, 0.3, 0.5])
  part = Mixture(loaders(rows=np.arange(4, 12)), seed=7, weights=[0.2, 0.3, 0.5])
  for t in range(5):
    x, y, src = whole.batch(t)
    px, py, psrc = part.batch(t)
    np.testing.assert_array_equal(px, x[4:12])
    np.testing.assert_array_equal(psrc, src[4:12])


def test_mismatched_sources_and_bad_weights_are_refused():
  ls = loaders()
  ls["docs"] = Loader(ls["docs"].tokens, batch_size=8, seq_len=8, seed=1, sampling="random", workers=0)
  with pytest.raises(DataError, match="share batch size"):
    Mixture(ls, seed=0, weights=[1, 1, 1])
  with pytest.raises(DataError, match="3 non-negative numbers"):
    Mixture(loaders(), seed=0, weights=[1, 1])
