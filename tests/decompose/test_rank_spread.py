"""--rank-spread energy: one total of shared dimensions, spread over the layers where they keep the most energy."""

import pytest
import torch

from collab_convert import CompressOptions, compress
from collab_convert.decompose.spectra import spread_budget
from collab_convert.errors import BadInputError


def test_the_strongest_directions_of_all_layers_are_kept_within_floors_and_ceilings():
    strong = torch.tensor([9.0, 8.0, 7.0, 6.0])
    weak = torch.tensor([5.0, 0.5, 0.4, 0.3])
    assert spread_budget([strong, weak], 6, [1, 1], [4, 4]) == [4, 2]
    assert spread_budget([strong, weak], 6, [1, 3], [4, 4]) == [3, 3]  # a floor holds
    assert spread_budget([strong, weak], 6, [1, 1], [2, 4]) == [2, 4]  # so does a ceiling
    assert spread_budget([strong, strong], 4, [1, 1], [4, 4]) == [2, 2]  # ties: alike


def test_the_total_is_the_uniform_ranks_and_the_report_says_how_it_was_spread(tiny_bert, tmp_path):
    from fixtures import SENTENCES

    texts = tmp_path / "calibration.txt"
    texts.write_text("\n".join(SENTENCES) + "\n")
    result = compress(str(tiny_bert), CompressOptions(rank=8, rank_spread="energy", calibration=texts,
                                                      output=tmp_path / "out", refine_steps=0))
    ranks = [layer.rank for layer in result.layers]
    heads = result.layers[0].num_heads
    assert sum(ranks) == 8 * len(ranks) and min(ranks) >= heads
    assert result.rank_choice["mode"] == "energy spread"
    assert "spread over the layers where they keep the most logit energy" in (tmp_path / "out" / "report.md").read_text()


def test_the_spread_is_refused_where_it_means_nothing(tiny_bert, tmp_path):
    with pytest.raises(BadInputError, match="--rank auto"):
        compress(str(tiny_bert), CompressOptions(rank="auto", rank_spread="energy", output=tmp_path / "out"))
    assert not (tmp_path / "out").exists()
