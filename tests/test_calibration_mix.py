"""--calibration-mix: an encoder's calibration covers short and long sequences and other styles, built from what
the user gave; language models take their texts as given."""

import json

from collab_convert import CompressOptions, compress
from collab_convert.io.calibration_mix import mixed, sentences, windows

DOCUMENT = " ".join(f"Sentence number {i} says something about the harbour." for i in range(60))


def test_sentences_split_after_end_marks_before_a_capital():
    assert sentences('He left. "Why?" she asked! It was 3 p.m. today. 2 more came.') == [
        "He left.", '"Why?" she asked!', "It was 3 p.m. today.", "2 more came."]


def test_a_long_text_gives_windows_past_its_first_and_a_short_one_none():
    found = windows(DOCUMENT, max_length=40)
    assert found and all(len(w.split()) <= 28 for w in found)
    assert " ".join(DOCUMENT.split()[28:]).startswith(found[0])
    assert windows("A few words only.", max_length=40) == []


def test_as_given_changes_nothing():
    texts = [DOCUMENT, "Short line."]
    assert mixed(texts, 128, "as-given").texts == texts


def test_lengths_interleave_each_text_with_a_sentence_and_its_windows():
    texts = [DOCUMENT, "One. Two words."]
    found = mixed(texts, 40, "lengths")
    assert found.texts[0] == DOCUMENT and found.texts[1] in sentences(DOCUMENT)
    assert found.counts["windows"] == len(windows(DOCUMENT, 40))
    assert "One. Two words." in found.texts and "Two words." in found.texts
    assert found.counts["built-in lines"] == 0


def test_built_in_lines_are_spread_through_the_users_texts():
    texts = [f"Text {i} is here. It has two sentences." for i in range(10)]
    found = mixed(texts, 128, "lengths+built-in", ["Built one. Two.", "Built two. Three."])
    positions = [found.texts.index(line) for line in ("Built one. Two.", "Built two. Three.")]
    assert found.counts["built-in lines"] == 2 and positions[0] < len(found.texts) // 2 < positions[1]
    assert "built-in lines" in found.description


def test_compress_records_the_mix_for_an_encoder(tiny_bert, tmp_path):
    texts = tmp_path / "texts.txt"
    texts.write_text("\n".join(f"the cat was on the mat. it is {w} again. and the {w} was on it." for w in "abcdefgh"))
    result = compress(str(tiny_bert), CompressOptions(rank=4, output=tmp_path / "out", calibration=texts,
                                                      calibration_samples=6, calibration_mix="lengths",
                                                      refine_steps=0))
    assert result.calibration["mix"].startswith("lengths: 6 texts as given")
    assert "single sentences" in json.loads((tmp_path / "out" / "report.json").read_text())["calibration"]["mix"]


def test_a_language_model_takes_its_lines_as_given_and_the_report_says_so(tmp_path):
    from collab_convert.stages import mixed_calibration

    class Source:
        config = {"architectures": ["LlamaForCausalLM"]}

    texts = [DOCUMENT, "Short line. Another one."]
    found, description = mixed_calibration(Source(), CompressOptions(rank=4, output=tmp_path / "out",
                                                                      calibration_mix="lengths"), texts)
    assert found == texts
    assert description == "lengths: the texts as given (a language model takes its lines as given)"
