"""Every output form, loaded the ordinary way (transformers alone, in a Python where collab_convert cannot be
imported, as if it were not installed): it loads right or refuses loudly, never silently wrong. A checkpoint that
needs our loader (the CP form; the shared-key form where it replaces a projection) declares a model_type of its own
and carries its modeling code: transformers refuses it and names trust_remote_code, whatever else is passed
(ignore_mismatched_sizes included); with that flag an encoder's CP checkpoint loads right, and the other forms are
refused with a line that says to install collab-convert. The multi-query checkpoint is stock and loads as it is; a
shared-key checkpoint that replaces nothing (a key norm keeps the key projection) loads as the original model."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from collab_convert import CompressOptions, compress
from fixtures.models import FAMILY_CASES, ROTARY_CASES, build_family, build_rotary

# The inputs every load is run on, and what is compared: written once, run by the loading script below (in a Python
# without collab_convert) and by `_ours` here. Encoders get a padded batch of two, so the carried code's masking is
# compared too.
RUN = r"""
import torch

def run(model, kind):
    generator = torch.Generator().manual_seed(0)
    if kind == "vision":
        inputs = {"pixel_values": torch.randn(1, 3, 16, 16, generator=generator)}
    else:
        inputs = {"input_ids": torch.randint(3, 50, (2 if kind == "text" else 1, 12), generator=generator)}
        if kind == "text":  # a padded batch, as sentence-transformers sends one
            inputs["attention_mask"] = torch.tensor([[1] * 12, [1] * 7 + [0] * 5])
        if kind == "seq2seq":
            inputs["decoder_input_ids"] = torch.randint(3, 50, (1, 7), generator=generator)
    with torch.no_grad():
        result = model(**inputs)
    return result.logits if hasattr(result, "logits") else result.last_hidden_state
"""

# Loads each checkpoint with transformers alone and prints what became of it: refused (and the error's last line),
# or its outputs' largest difference from a reference folder loaded the same way.
PLAIN = r"""
import sys
sys.modules["collab_convert"] = None  # not installed: any import of it fails
import json, torch, transformers
cases = json.loads(sys.argv[1])
""" + RUN + r"""

def outputs(folder, auto, kind, trust=False, force=False):
    # force: what transformers' own refusal of a size mismatch suggests, which would initialise the replaced projections
    extra = {"ignore_mismatched_sizes": True} if force else {}
    return run(getattr(transformers, auto).from_pretrained(folder, trust_remote_code=trust, **extra).eval(), kind)

seen = {}
for name, case in cases.items():
    try:
        loaded = outputs(case["folder"], case["auto"], case["kind"], case.get("trust", False), case.get("force", False))
    except Exception as error:
        seen[name] = {"refused": str(error).strip().splitlines()[-1]}
        continue
    # the original, loaded the same way; or what our loader makes of the checkpoint (saved by the test)
    reference = torch.load(case["ours"]) if "ours" in case else outputs(case["reference"], case["auto"], case["kind"])
    seen[name] = {"difference": float((loaded - reference).abs().max() / reference.abs().max())}
print(json.dumps({"seen": seen, "imported_us": sys.modules.get("collab_convert") is not None}))
"""


def _ours(folder, auto, kind):
    """The checkpoint's outputs through collab_convert's own loader, on the inputs the loading script makes."""
    import transformers

    import collab_convert

    defined = {}
    exec(RUN, defined)  # the loading script's own inputs, not a copy of them
    return defined["run"](collab_convert.load_model(folder, getattr(transformers, auto)).eval(), kind)


ROTARY = {case.name: case for case in ROTARY_CASES}
# Families whose CP form the carried code runs: modules that call separate query and key projections and dispatch
# to the attention interface, and MPNet's, whose inline forward it restates.
CARRIED_FORWARD = {"bert", "roberta", "xlm-roberta", "electra", "distilbert", "albert", "vit", "deit", "mpnet", "bart"}


def _cases(root):
    """name -> (what a plain load must do, the case for the loading script)."""
    cases = {}

    def add(name, expected, source, options, auto, kind):
        out = root / name
        compress(str(source), CompressOptions(output=out, **options))
        cases[name] = (expected, {"folder": str(out), "reference": str(source), "auto": auto, "kind": kind})

    def add_trusted(name, runs_here, auto, kind):
        """The same folder loaded with trust_remote_code=True: our loader's outputs where its code runs the form."""
        if not runs_here:
            cases[f"{name}, its own code trusted"] = ("refuses", {**cases[name][1], "trust": True})
            return
        expected = root / f"{name}-ours.pt"
        torch.save(_ours(root / name, auto, kind), expected)
        cases[f"{name}, its own code trusted"] = ("our loader's outputs",
                                                  {**cases[name][1], "trust": True, "ours": str(expected)})

    for family in FAMILY_CASES:
        source = root / f"{family.name}-in"
        build_family(family, source)
        name = f"{family.name} collaborative"
        add(name, "refuses", source, {"rank": family.full_rank // 2}, family.auto, family.kind)
        cases[f"{name}, mismatches ignored"] = ("refuses", {**cases[name][1], "force": True})
        add_trusted(name, family.name in CARRIED_FORWARD, family.auto, family.kind)
        if family.name == "bert":  # exact at full rank, and still only through our loader
            add("bert collaborative full rank", "refuses", source, {"rank": family.full_rank}, family.auto,
                family.kind)
            add_trusted("bert collaborative full rank", True, family.auto, family.kind)
        if family.name in ("gpt2", "t5"):
            add(f"{family.name} shared-key", "refuses", source, {"form": "shared-key", "key_cache": 0.5},
                family.auto, family.kind)
            add_trusted(f"{family.name} shared-key", False, family.auto, family.kind)
    for name in ("llama", "phi3", "gpt_neox", "qwen3"):
        source = root / f"{name}-in"
        build_rotary(ROTARY[name], source)
        # Qwen3's key norm sits between its key projection and RoPE: the form keeps the projection, replaces nothing
        add(f"{name} shared-key", "the original" if name == "qwen3" else "refuses", source, {"key_cache": 0.5},
            "AutoModelForCausalLM", "causal")
        if name != "qwen3":
            case = cases[f"{name} shared-key"][1]
            cases[f"{name} shared-key, mismatches ignored"] = ("refuses", {**case, "force": True})
            add_trusted(f"{name} shared-key", False, "AutoModelForCausalLM", "causal")
            # its class named directly reads any model_type: the load guard still refuses
            cases[f"{name} shared-key, its class named"] = ("refuses", {**case, "auto": ROTARY[name].model_class})
        if name in ("llama", "phi3"):
            add(f"{name} multi-query full width", "the original", source, {"kv_cache": 1.0},
                "AutoModelForCausalLM", "causal")
    return cases


@pytest.fixture(scope="module")
def plain_loads(tmp_path_factory):
    cases = _cases(tmp_path_factory.mktemp("plain"))
    seen = {}
    # Trusted code registers its loader in the process for good: the loads without the flag run in another one,
    # and the trusted ones all in one, as a user loading checkpoints of several families would.
    for trusted in (False, True):
        chosen = {name: case for name, (_, case) in cases.items() if case.get("trust", False) == trusted}
        # no terminal: transformers asks whether to run the carried code only where someone could answer
        done = subprocess.run([sys.executable, "-c", PLAIN, json.dumps(chosen)], capture_output=True, text=True,
                              check=True, stdin=subprocess.DEVNULL)
        report = json.loads(done.stdout.strip().splitlines()[-1])
        assert not report["imported_us"]
        seen.update(report["seen"])
    return {name: (expected, seen[name], Path(case["folder"])) for name, (expected, case) in cases.items()}


@pytest.mark.slow
def test_no_output_form_loads_silently_wrong_without_our_package(plain_loads):
    wrong = {}
    for name, (expected, seen, _) in plain_loads.items():
        if expected == "refuses" and "refused" not in seen:
            wrong[name] = f"loaded (outputs {seen['difference']:.2e} from the original)"
        if expected in ("the original", "our loader's outputs") and seen.get("difference", 1.0) > 1e-4:
            wrong[name] = seen
    assert not wrong, wrong


@pytest.mark.slow
def test_the_cp_form_loads_right_with_its_own_code_where_the_user_trusts_it(plain_loads):
    """BERT-like, DistilBERT, ALBERT and ViT modules, and BART's (encoder, decoder and cross-attention), run their
    own forward over separate query and key projections: the code the checkpoint carries swaps them as our loader
    does, with no collab_convert to import. MPNet scores inline (with its relative position bias): the carried code
    restates that forward."""
    trusted = {name: seen for name, (expected, seen, _) in plain_loads.items() if expected == "our loader's outputs"}
    assert {name.split(" ")[0] for name in trusted} == CARRIED_FORWARD
    assert all(seen.get("difference", 1.0) <= 1e-5 for seen in trusted.values()), trusted


@pytest.mark.slow
def test_each_refusal_says_what_to_do(plain_loads):
    """Untrusted, transformers' own refusal of a model_type it does not know names trust_remote_code; trusted,
    where the carried code does not run the form, its refusal names collab-convert. A model class named directly
    reads any model_type, and the load guard refuses (a size mismatch)."""
    wrong = {}
    for name, (expected, seen, _) in plain_loads.items():
        wanted = ("pip install collab-convert" if name.endswith("trusted") else
                  "ignore_mismatched_sizes" if name.endswith("class named") else "trust_remote_code=True")
        if "refused" in seen and wanted not in seen["refused"]:
            wrong[name] = seen["refused"]
    assert not wrong, wrong


@pytest.mark.slow
def test_each_card_says_what_loading_without_our_package_does(plain_loads):
    """The card is what a user downloading a released checkpoint reads: it must say what transformers alone will do
    with it (refuse, and run the carried code or refuse again when trusted; or load the original), as the loads
    above found."""
    from collab_convert.report.card import CARRIED_CODE, GUARDED, UNGUARDED

    wrong = {}
    for name, (expected, seen, folder) in plain_loads.items():
        if "," in name:
            continue  # another load of a folder, read here under the folder's own name
        card = (folder / "README.md").read_text()
        if expected == "refuses":
            trusted = plain_loads[f"{name}, its own code trusted"][1]
            said = GUARDED if "refused" in trusted else CARRIED_CODE
        elif "multi-query" in name:
            said = "It is a stock checkpoint of its family"
        else:
            said = UNGUARDED
        if said not in card:
            wrong[name] = card[card.find("Load it"):][:300]
    assert not wrong, wrong


def test_our_loader_reads_a_guarded_checkpoint_without_a_warning(tmp_path, caplog):
    """The guard is no parameter of the converted model: loading through collab_convert reports nothing unexpected."""
    from transformers import AutoModel

    import collab_convert
    from collab_convert.io.reader import TensorReader

    family = next(case for case in FAMILY_CASES if case.name == "bert")
    build_family(family, tmp_path / "in")
    compress(str(tmp_path / "in"), CompressOptions(output=tmp_path / "out", rank=8))
    reader = TensorReader(tmp_path / "out")
    guards = [name for name in reader.names() if reader.spec(name).shape == (0,)]
    assert guards == [f"encoder.layer.{i}.attention.self.query.weight" for i in range(2)]
    with caplog.at_level("WARNING"):
        collab_convert.load_model(tmp_path / "out", AutoModel)
    assert not [record for record in caplog.records if "UNEXPECTED" in record.getMessage()]


def test_a_checkpoint_whose_record_lost_its_original_model_type_is_refused_in_one_line(tmp_path):
    """config.json's own model_type reads as the original's through the record; an altered record must not send
    transformers round in circles (our registered type reading itself) but say what happened."""
    from transformers import AutoConfig

    import collab_convert
    from collab_convert.errors import BadInputError

    family = next(case for case in FAMILY_CASES if case.name == "bert")
    build_family(family, tmp_path / "in")
    compress(str(tmp_path / "in"), CompressOptions(rank=8, output=tmp_path / "out"))
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    del config["quantization_config"]["original_model_type"]
    (tmp_path / "out" / "config.json").write_text(json.dumps(config))
    for load in (AutoConfig.from_pretrained, collab_convert.load_model):
        with pytest.raises(BadInputError, match="record names no original model type .* was altered"):
            load(tmp_path / "out")


CACHED_DECODING = r"""
import sys
sys.modules["collab_convert"] = None
import json, torch
from transformers import AutoModelForSeq2SeqLM
model = AutoModelForSeq2SeqLM.from_pretrained(sys.argv[1], trust_remote_code=True).eval()
generator = torch.Generator().manual_seed(3)
ids, decoder = torch.randint(3, 50, (2, 12), generator=generator), torch.randint(3, 50, (2, 8), generator=generator)
with torch.no_grad():
    whole = model(input_ids=ids, decoder_input_ids=decoder).logits
    steps, past = [], None
    for t in range(decoder.shape[1]):
        out = model(input_ids=ids, decoder_input_ids=decoder[:, t : t + 1], past_key_values=past, use_cache=True)
        steps.append(out.logits)
        past = out.past_key_values
print(json.dumps({"difference": float((torch.cat(steps, 1) - whole).abs().max() / whole.abs().max())}))
"""


@pytest.mark.slow
def test_bart_decodes_with_its_caches_through_its_own_code(tmp_path):
    """The carried code runs BART's own forward, whose caches (self-attention and the encoder's keys) then hold
    whole padded pseudo-heads: step-by-step decoding gives the logits of one pass over the whole sequence."""
    family = next(case for case in FAMILY_CASES if case.name == "bart")
    build_family(family, tmp_path / "in")
    compress(str(tmp_path / "in"), CompressOptions(rank=family.full_rank // 2, output=tmp_path / "out"))
    done = subprocess.run([sys.executable, "-c", CACHED_DECODING, str(tmp_path / "out")], capture_output=True,
                          text=True, check=True, stdin=subprocess.DEVNULL)
    assert json.loads(done.stdout.strip().splitlines()[-1])["difference"] < 1e-5
