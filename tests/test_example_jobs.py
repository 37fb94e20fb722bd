"""Every example job of launch/jobs/ loads through the schema and its checks (its data and
checkpoint paths are the user's to provide)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from vlmcp.config import job_from_dict

JOBS = sorted((Path(__file__).resolve().parents[1] / "launch" / "jobs").glob("*.json"))


@pytest.mark.parametrize("path", JOBS, ids=lambda p: p.name)
def test_every_example_job_passes_the_schema_and_its_cross_key_rules(path):
    job_from_dict(json.loads(path.read_text()), path.parent)
