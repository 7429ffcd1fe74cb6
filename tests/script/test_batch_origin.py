"""`nanaudit run --keep-going` names the data set's samples of each skipped step's bad rows
(script/batch_origin.py): no re-run traces a skipped step's data code, so the DataLoader's
sampler indices of the batch the model got are read instead, shuffled, from worker processes
too, and an id leaf the batch carries. Before, the skip list of a run had the step and the
rows alone, useless to a loop that filters its data set."""

from __future__ import annotations

import json
import textwrap

import pytest
from helpers import run_cli

# Samples 9 and 30 of 64 hold a NaN; a shuffled DataLoader of 8 a batch, its generator seeded.
SCRIPT = """
    import sys

    import torch
    from torch import nn
    from torch.utils.data import DataLoader, Dataset

    class Rows(Dataset):
        def __len__(self):
            return 64

        def __getitem__(self, i):
            x = torch.randn(4, generator=torch.Generator().manual_seed(i))
            if i in (9, 30):
                x[1] = float("nan")
            return {"x": x, "y": x.sum(0, keepdim=True), "id": 1000 + i}

    if __name__ == "__main__":
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
        loader = DataLoader(Rows(), batch_size=8, shuffle=True, num_workers=int(sys.argv[1]),
                            generator=torch.Generator().manual_seed(3))
        for batch in loader:
            loss = nn.functional.mse_loss(model(batch["x"]), batch["y"])
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
"""


@pytest.mark.parametrize("workers", [0, 2])
def test_each_skipped_steps_rows_are_named_by_their_data_set_index_and_id(tmp_path, workers):
    script, skip = tmp_path / "train.py", tmp_path / "skip.json"
    script.write_text(textwrap.dedent(SCRIPT))
    result = run_cli("run", "-q", "--keep-going", "--skip-list", skip, "--json",
                     tmp_path / "report.json", script, str(workers))
    assert result.code == 1, result.stderr
    entries = json.loads(skip.read_text())["skip"]
    assert sorted((e["sample_indices"], e["sample_ids"]) for e in entries) == [
        ([9], [1009]), ([30], [1030])]
    report = json.loads((tmp_path / "report.json").read_text())
    for finding in report["findings"]:
        assert finding["producer"]["sample_indices"][0] in (9, 30)
        assert "the data set's indices of those rows" in finding["explanation"]
