"""The site's navigation lists the records and notebooks from the files (docs/hooks.py `on_config`): a new
benchmark record, experiment page or notebook appears without an edit of mkdocs.yml, a run's working files do not."""

import importlib.util
import os

import yaml

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
spec = importlib.util.spec_from_file_location("docs_hooks", os.path.join(ROOT, "docs", "hooks.py"))
hooks = importlib.util.module_from_spec(spec)
spec.loader.exec_module(hooks)


def test_the_generated_sections_list_every_record_and_notebook(tmp_path):
  for path in ("results/bench_x.md", "results/new_exp/results.md", "results/new_exp/extra.md",
               "results/new_exp/tune/summary.md", "results/new_exp/runs/w32/summary.md", "results/plot.png",
               "notebooks/zeta.ipynb", "notebooks/quickstart.ipynb", "notebooks/alpha.ipynb"):
    (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
    (tmp_path / path).write_text("x")
  config = {"docs_dir": str(tmp_path), "nav": ["index.md", {"Benchmarks": ["benchmarks.md"]},
                                               {"Experiments and results": ["experiments.md"]}, {"Notebooks": []},
                                               {"Other": ["other.md"]}]}
  nav = hooks.on_config(config)["nav"]
  assert nav[1] == {"Benchmarks": ["benchmarks.md", {"bench x": "results/bench_x.md"}]}
  assert nav[2] == {"Experiments and results": ["experiments.md", {"new exp": "results/new_exp/results.md"},
                                                {"new exp / extra": "results/new_exp/extra.md"},
                                                {"new exp / tune / summary": "results/new_exp/tune/summary.md"}]}
  assert nav[3] == {"Notebooks": [{"quickstart": "notebooks/quickstart.ipynb"}, {"alpha": "notebooks/alpha.ipynb"},
                                  {"zeta": "notebooks/zeta.ipynb"}]}
  assert nav[0] == "index.md" and nav[4] == {"Other": ["other.md"]}


def test_the_site_has_every_generated_section():
  """A section renamed in mkdocs.yml would stop its list being generated (and the build would fail on the pages
  left out of the navigation): each one the hook fills is there."""
  nav = yaml.safe_load(open(os.path.join(ROOT, "mkdocs.yml")))["nav"]
  titles = {next(iter(s)) for s in nav if isinstance(s, dict)}
  assert set(hooks.GENERATED) <= titles
