"""The README and docs/ stay true to the code: the configuration reference is the models' own, links resolve, the
README stays short with its two-command quick start, and every benchmark record is one the docs cite."""

import re
from pathlib import Path

from configs import reference

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
RECORD = re.compile(r"\d{4}-\d{2}-\d{2}-[\w.-]+?\.(?:json|png|json\.gz)")


def test_the_configuration_reference_is_rendered_from_the_models():
    page = (ROOT / "docs" / "configuration.md").read_text()
    assert reference.splice(page) == page, "run: python -m configs.reference --write docs/configuration.md"


def test_the_reference_lists_every_field_with_its_description():
    rendered = reference.render()
    for _, model, _ in reference.SECTIONS:
        for name, field in model.model_fields.items():
            if not field.exclude:
                assert f"| `{name}` |" in rendered, (model.__name__, name)


def test_the_readme_is_short_and_its_quick_start_is_two_commands():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 300
    quick = readme.split("## Quick start", 1)[1].split("## ", 1)[0]
    commands = [line for line in re.findall(r"```bash\n(.*?)```", quick, re.S)[0].splitlines() if line.strip()]
    assert [c.split()[0] for c in commands] == ["./dspark", "./run-tests"]
    ci = (ROOT / ".ci" / "run").read_text()
    assert "./run-tests" in ci


def test_every_relative_link_resolves():
    for page in PAGES:
        for target in re.findall(r"\]\(([^)#:]+)(?:#[^)]*)?\)", page.read_text()):
            assert (page.parent / target).exists(), f"{page.name} links to {target}"


def test_every_benchmark_record_is_cited_and_every_citation_exists():
    text = "\n".join(page.read_text() for page in PAGES)
    cited = set(RECORD.findall(text))
    kept = {p.name for p in (ROOT / "benchmarks" / "results").iterdir()}
    assert not (cited - kept), f"cited but missing: {sorted(cited - kept)}"
    assert not (kept - cited), f"records no page cites (drop them, or cite them): {sorted(kept - cited)}"

