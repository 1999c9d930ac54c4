"""Reports and the model card are written from result objects and metadata, never a loaded model."""

import pytest

from collab_convert.decompose.costs import (
    LayerShape,
    SharedKeyShape,
    collaborative_cost,
    original_cost,
    original_grouped_cost,
    shared_key_cost,
)
from collab_convert.forms import form_named
from collab_convert.report.card import CardSource, write_model_card
from collab_convert.report.reports import markdown_report, write_reports
from collab_convert.results import CollaborativeLayerReport, CompressResult, SharedKeyLayerReport

CP = form_named("collaborative")


def a_result() -> CompressResult:
    shape = LayerShape(input_dim=48, num_heads=4, head_dim=12)
    before, after = original_cost(shape), collaborative_cost(shape, 16)
    layer = CollaborativeLayerReport(
        name="encoder.layer.0.attention.self", rank=16, num_heads=4, head_dim=12, input_dim=48,
        relative_error=0.25, logit_error=None, refinement=None, per_head_truncation_error=0.5,
        initialisation="per-head truncation", iterations=7, parameters_before=before.parameters,
        parameters_after=after.parameters, seconds=0.1, cost_before=before.as_dict(), cost_after=after.as_dict(),
    )
    return CompressResult(model="acme/tiny", output="/tmp/out", family="bert", form="collaborative",
                          method="tucker-cp-als", layers=[layer], files=[], seconds=1.0)


def a_shared_key_result() -> CompressResult:
    shape = SharedKeyShape(input_dim=64, num_heads=4, kv_heads=2, head_dim=16)
    before, after = original_grouped_cost(shape), shared_key_cost(shape, 16)
    layer = SharedKeyLayerReport(
        name="model.layers.0.self_attn", rank=16, num_heads=4, head_dim=16, input_dim=64, relative_error=0.125,
        logit_error=None, refinement=None, parameters_before=before.parameters, parameters_after=after.parameters,
        seconds=0.1, cost_before=before.as_dict(), cost_after=after.as_dict(), kv_heads=2,
        initialisation="weighted PCA of the keys per rotary frequency", frequency_ranks=[2, 2, 2, 1, 1, 0, 0, 0],
        pass_rank=0,
    )
    return CompressResult(model="acme/llama", output="/tmp/out", family="llama", form="shared-key", method=None,
                          layers=[layer], files=[], seconds=1.0)


def test_markdown_report_shows_errors_and_costs_per_layer():
    text = markdown_report(a_result(), CP)
    assert "encoder.layer.0.attention.self | 16 | 0.2500 | 0.5000" in text
    assert "Q/K MACs per token n=2048" in text and "key cache" in text


def test_report_and_card_tell_the_same_story(tmp_path):
    result = a_result()
    result.fidelity = {"measured_on": "32 held-out lines of news.txt", "cosine_mean": 0.991, "cosine_p01": 0.972}
    write_model_card(result, CP, CardSource(base_model="acme/tiny"), tmp_path)
    card, report = (tmp_path / "README.md").read_text(), markdown_report(result, CP)
    for text in (card, report):
        assert "query and a key projection of rank 16 (full rank, where the form is exact: 48)" in text
        assert "query/key multiply-adds per token (projections plus scores against n keys): n=128:" in text
        assert "key cache per token (decoders), all layers: 48 -> 20 numbers" in text
        assert "measured on 32 held-out lines of news.txt: embedding cosine mean 0.9910, 1st percentile 0.9720" in text
    # scores: 4 heads x (16 + 1) - 48 = 20 more per key; projections save 2*48*48 - (2*48*16 + 4*16 + 48*4) = 2816
    assert "costs less per token than the original below about 140 tokens" in card


def test_a_fidelity_figure_says_it_is_on_the_calibrations_kind_of_text_and_how_to_measure_other_text(tmp_path):
    result = a_result()
    result.fidelity = {"measured_on": "32 held-out lines of news.txt", "cosine_mean": 0.991, "cosine_p01": 0.972}
    write_model_card(result, CP, CardSource(base_model="acme/tiny"), tmp_path)
    for text in ((tmp_path / "README.md").read_text(), markdown_report(result, CP)):
        assert ("1st percentile 0.9720 (text like the calibration text; other text can score lower: measure yours "
                "with `collab-convert verify OUT --texts FILE`)") in text


def test_the_report_names_the_held_out_texts_served_worst_and_the_published_card_quotes_none(tmp_path):
    result = a_result()
    worst = [{"cosine": 0.9312, "text": "a line the model serves worst"}, {"cosine": 0.9577, "text": "the next"}]
    result.fidelity = {"measured_on": "32 held-out lines of news.txt", "cosine_mean": 0.991, "cosine_p01": 0.972,
                       "worst_texts": worst}
    write_model_card(result, CP, CardSource(base_model="acme/tiny"), tmp_path)
    report = markdown_report(result, CP)
    assert "- the 2 held-out texts with the lowest embedding cosine:" in report
    assert "  - 0.9312: a line the model serves worst\n  - 0.9577: the next" in report
    card = (tmp_path / "README.md").read_text()
    assert "1st percentile 0.9720" in card and "serves worst" not in card


def test_the_worst_texts_are_the_lowest_cosines_lowest_first_on_one_short_line():
    import torch

    from collab_convert.integration.fidelity import cosine_stats, worst_texts

    reference = torch.eye(8)
    candidate = torch.eye(8)
    for index, blend in [(2, 0.9), (5, 0.5), (6, 0.7)]:  # text i drifts toward another: cosines 0.11, 0.71, 0.39
        candidate[index] = reference[index] * (1 - blend) + reference[(index + 1) % 8] * blend
    texts = [f"text {i}" for i in range(8)]
    texts[5] = "a long\nline " + "x" * 200
    stats = cosine_stats(reference, candidate)
    shown = worst_texts(stats, texts, width=40)
    assert [entry["text"][:6] for entry in shown[:3]] == ["text 2", "text 6", "a long"]
    assert shown[0]["cosine"] == pytest.approx(stats.minimum) and len(shown) == 5
    assert "\n" not in shown[2]["text"] and len(shown[2]["text"]) == 40 and shown[2]["text"].endswith("...")


def test_without_measurements_the_card_says_how_to_measure(tmp_path):
    write_model_card(a_result(), CP, CardSource(base_model=None), tmp_path)
    assert "fidelity: not measured here (compress with --calibration measures it on held-out lines); run `collab-convert verify" in (tmp_path / "README.md").read_text()


def test_card_front_matter_comes_from_the_source_metadata(tmp_path):
    source = CardSource(base_model="acme/tiny", front_matter={"tags": ["sentence-similarity"],
                                                             "pipeline_tag": "feature-extraction"},
                        license="apache-2.0")
    assert write_model_card(a_result(), CP, source, tmp_path) == ["README.md"]
    card = (tmp_path / "README.md").read_text()
    assert card.startswith("---\nbase_model: acme/tiny\nbase_model_relation: quantized\n")
    assert "license: apache-2.0" in card and "pipeline_tag: feature-extraction" in card
    assert "- collaborative-attention" in card and "- sentence-similarity" in card


def test_report_json_replaces_non_finite_numbers(tmp_path):
    result = a_result()
    result.layers[0].per_head_truncation_error = float("nan")
    write_reports(result, CP, tmp_path)
    assert '"per_head_truncation_error": null' in (tmp_path / "report.json").read_text()


def test_a_shared_key_report_reads_in_its_own_terms(tmp_path):
    result = a_shared_key_result()
    form = form_named(result.form)
    report = markdown_report(result, form)
    write_model_card(result, form, CardSource(base_model="acme/llama"), tmp_path)
    card = (tmp_path / "README.md").read_text()
    assert "| layer | shared key | score energy lost | params before |" in report
    assert "| model.layers.0.self_attn | 16 | 0.1250 |" in report
    assert "| model.layers.0.self_attn | 2 2 2 1 1 0 0 0 | 0 |" in report  # the key's split over RoPE frequencies
    assert "per-head truncation" not in report and "mixing vector" not in card
    for text in (report, card):
        assert "keeps its per-head queries and shares one rotary key across its key heads" in text
        assert "score energy lost (weighted by the queries that read the keys): 0.1250" in text
    assert "form: shared-key (collab-convert" in report
    write_reports(result, form, tmp_path)
    assert '"form": "shared-key"' in (tmp_path / "report.json").read_text()


def test_an_encoder_has_no_key_cache_line(tmp_path):
    """Encoders cache nothing (their costs count no cache); the card and report.md say nothing of a cache."""
    result = a_result()
    for layer in result.layers:
        layer.cost_before["key_cache_per_token"] = layer.cost_after["key_cache_per_token"] = 0
    write_model_card(result, CP, CardSource(base_model="acme/tiny"), tmp_path)
    for text in ((tmp_path / "README.md").read_text(), markdown_report(result, CP)):
        assert "key cache per token (decoders), all layers" not in text
