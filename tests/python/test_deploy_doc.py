"""docs/deploy.md shows tools/docker/Dockerfile; the copy must not drift from the file people build."""
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[2]


def without_comments(text):
    return [line for line in text.splitlines()
            if line.strip() and (not line.startswith("#") or line.startswith("# syntax="))]


def test_the_dockerfile_in_the_deploy_doc_is_the_real_one_without_its_comments():
    doc = (ROOT / "docs" / "deploy.md").read_text()
    [shown] = re.findall(r"```dockerfile\n(.*?)```", doc, re.S)
    assert without_comments(shown) == without_comments((ROOT / "tools" / "docker" / "Dockerfile").read_text())
