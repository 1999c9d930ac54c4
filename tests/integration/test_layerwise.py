"""Calibration a block at a time: the same statistics as whole forward passes, one layer in memory at a time."""

import sys

import pytest
import torch

from collab_convert.architectures.source import open_model
from collab_convert.integration import batches as batching
from collab_convert.integration import model_runs
from collab_convert.integration.capture import collect_statistics
from collab_convert.integration.layerwise import plan_blocks
from collab_convert.io.spill import SpillFolder

from fixtures import SENTENCES
from fixtures.models import CharacterTokenizer, build_family, family_case


def _statistics(folder, scratch=None):
    source = open_model(str(folder))
    try:
        prefixes = [layer.prefix for layer in source.layers]
        return collect_statistics(source.folder, source.layout, source.family.position_bias, prefixes, SENTENCES[:12], max_length=24,
                                  keep_samples=3, scratch=scratch)[0]
    finally:
        source.close()


@pytest.mark.parametrize("family", ["bert", "roberta", "distilbert", "electra", "mpnet", "gpt2", "gpt_bigcode", "opt"])
def test_block_at_a_time_statistics_equal_whole_passes(family, tmp_path, monkeypatch):
    monkeypatch.setattr(model_runs, "calibration_tokenizer", lambda folder: CharacterTokenizer())
    # several batches: after the first, the last block's runs stop at its last observation
    monkeypatch.setattr(batching, "BATCH_SEQUENCES", 5)
    folder = tmp_path / family
    build_family(family_case(family), folder)
    whole = _statistics(folder)
    by_block = _statistics(folder, scratch=tmp_path / "scratch")
    assert isinstance(by_block, SpillFolder)  # statistics wait on disk, one layer loaded when asked for
    assert list(by_block) == list(whole)
    for prefix, expected in whole.items():
        layer = by_block[prefix]
        for side in ("query", "key"):
            mine, theirs = getattr(layer, side), getattr(expected, side)
            assert torch.allclose(mine.covariance, theirs.covariance, rtol=1e-4, atol=1e-5), (prefix, side)
            assert torch.allclose(mine.mean, theirs.mean, rtol=1e-4, atol=1e-5)
        assert layer.scaling == expected.scaling
        assert [s.shape for s in layer.query_samples] == [s.shape for s in expected.query_samples]
        for mine, theirs in zip(layer.query_samples, expected.query_samples):
            assert torch.allclose(mine.float(), theirs.float(), atol=2e-3)


def test_held_or_spilled_keeps_what_fits_in_memory_and_the_rest_on_disk(tmp_path):
    from collab_convert.io.spill import HeldOrSpilled

    store = HeldOrSpilled(tmp_path, budget=4 * 4)  # room for four float32 numbers
    store["first"], store["second"] = torch.arange(3.0), {"mask": torch.ones(2)}
    assert list(store.held) == ["first"] and store.used == 12
    assert list(store.spilled) == ["second"] and len(list(tmp_path.iterdir())) == 1
    kept = store["first"]
    store["first"] = torch.full((3,), 7.0)  # the same shape: written into the tensor held, not a new one
    assert store["first"] is kept and torch.equal(kept, torch.full((3,), 7.0))
    assert torch.equal(store["second"]["mask"], torch.ones(2))
    store["first"] = torch.zeros(5)  # larger than the budget now: to disk, and the memory it held is free
    assert not store.held and store.used == 0 and torch.equal(store["first"], torch.zeros(5))
    assert list(store.spilled) == ["second", "first"] and len(list(tmp_path.iterdir())) == 2


def test_activations_wait_in_memory_only_beside_the_working_set_of_the_block_that_runs():
    """Held activations share the memory bound with the block that runs: a checkpoint of few large blocks (or
    one whose blocks run wider than it is stored) keeps them on disk, one of many small blocks in memory."""
    from collab_convert.integration.layerwise import BLOCK_WORKING_SET, HELD_SHARE, held_bytes

    checkpoint = 400_000_000
    room = int(HELD_SHARE * checkpoint)
    assert held_bytes(checkpoint, block_bytes=room // BLOCK_WORKING_SET) == 0
    assert held_bytes(checkpoint, block_bytes=2 * room) == 0  # never below nothing
    assert held_bytes(checkpoint, block_bytes=room // (4 * BLOCK_WORKING_SET)) == room - room // 4


@pytest.mark.parametrize("held", ["none", "some", "all"])
def test_activations_between_blocks_wait_in_memory_or_on_disk_alike(held, tmp_path, monkeypatch):
    """Up to a share of the checkpoint's bytes a batch's activations stay in memory between blocks, the rest wait
    on disk: the statistics are the same whichever way each batch waited."""
    from collab_convert.integration import layerwise

    monkeypatch.setattr(model_runs, "calibration_tokenizer", lambda folder: CharacterTokenizer())
    monkeypatch.setattr(batching, "BATCH_SEQUENCES", 3)
    runners = []
    made = layerwise.BlockRunner.__init__

    def remembered(self, *args, **kwargs):
        made(self, *args, **kwargs)
        self.activations.budget = {"none": 0, "some": 6_000, "all": 1 << 30}[held]
        runners.append(self)

    monkeypatch.setattr(layerwise.BlockRunner, "__init__", remembered)
    folder = tmp_path / "gpt2"
    build_family(family_case("gpt2"), folder)
    whole = _statistics(folder)
    by_block = _statistics(folder, scratch=tmp_path / "scratch")
    in_memory = len(runners[0].activations.held)
    on_disk = len([path for path in (tmp_path / "scratch" / "activations").iterdir() if path.is_file()])
    assert in_memory + on_disk == 2 * runners[0].batches  # each batch's inputs and hidden states, one place each
    assert {"none": on_disk == 2 * runners[0].batches, "some": in_memory and on_disk,
            "all": in_memory == 2 * runners[0].batches}[held]
    assert runners[0].activations.used <= runners[0].activations.budget
    for prefix, expected in whole.items():
        for side in ("query", "key"):
            mine, theirs = getattr(by_block[prefix], side), getattr(expected, side)
            assert torch.allclose(mine.covariance, theirs.covariance, rtol=1e-4, atol=1e-5), (prefix, side)


@pytest.mark.parametrize("family", ["albert", "bart", "t5"])
def test_shared_layers_and_two_stacks_run_whole(family, tmp_path):
    """ALBERT runs one block many times per pass; encoder-decoder models have two stacks: whole passes."""
    folder = tmp_path / family
    build_family(family_case(family), folder)
    source = open_model(str(folder))
    try:
        assert plan_blocks(source.folder, [layer.prefix for layer in source.layers]) is None
    finally:
        source.close()


def test_blocks_with_different_masks_run_whole(tmp_path):
    """Gemma 2 alternates sliding-window and full layers: the first block's mask would be wrong for the next."""
    from fixtures.models import ROTARY_CASES, build_rotary

    build_rotary(next(case for case in ROTARY_CASES if case.name == "gemma2"), tmp_path / "gemma2")
    source = open_model(str(tmp_path / "gemma2"))
    try:
        assert plan_blocks(source.folder, [layer.prefix for layer in source.layers]) is None
    finally:
        source.close()


def test_spill_folder_keeps_objects_on_disk(tmp_path):
    spilled = SpillFolder(tmp_path / "spill")
    spilled["first"], spilled["second"] = {"tensor": torch.arange(3)}, [1, 2]
    assert list(spilled) == ["first", "second"] and len(spilled) == 2
    assert torch.equal(spilled.pop("first")["tensor"], torch.arange(3))
    assert list(spilled) == ["second"] and spilled["second"] == [1, 2]
    assert "second" in spilled and "first" not in spilled
    assert len(list((tmp_path / "spill").glob("*.pt"))) == 1


def test_spill_folder_writes_plain_tensors_as_their_bytes_and_reads_them_back_alike(tmp_path):
    """A block's activations are written raw (no pickle around them): every dtype, shape and layout comes back
    equal, and a key that changes between a tensor and another object keeps its place and one file."""
    spilled = SpillFolder(tmp_path / "spill")
    values = {"bfloat16": torch.randn(2, 3, 4).to(torch.bfloat16), "bool": torch.tensor([True, False, True]),
              "scalar": torch.tensor(2.5, dtype=torch.float64), "empty": torch.zeros(0, 4),
              "transposed": torch.arange(12.0).reshape(3, 4).t(), "long": torch.arange(5)}
    for key, value in values.items():
        spilled[key] = value
    for key, value in values.items():
        back = spilled[key]
        assert back.dtype == value.dtype and back.shape == value.shape and torch.equal(back, value), key
    assert all(path.suffix == ".raw" for path in (tmp_path / "spill").iterdir())
    spilled["bool"] = {"mask": torch.ones(2)}  # a tensor replaced by another object, and back again
    assert torch.equal(spilled["bool"]["mask"], torch.ones(2))
    spilled["bool"] = torch.full((2,), 7)
    assert torch.equal(spilled["bool"], torch.full((2,), 7)) and list(spilled) == list(values)
    assert len(list((tmp_path / "spill").iterdir())) == len(values)
    del spilled["bool"]
    assert "bool" not in spilled and len(list((tmp_path / "spill").iterdir())) == len(values) - 1


def test_offloaded_collaborative_model_runs_as_loaded_whole(tmp_path):
    """A collaborative attention module reads its submodules' weights directly: one hook per block loads them all."""
    from transformers import AutoModelForCausalLM

    from collab_convert import CompressOptions, compress
    from collab_convert.integration.layerwise import load_offloaded
    from collab_convert.integration.loading import load_model

    build_family(family_case("gpt2"), tmp_path / "gpt2")
    compress(str(tmp_path / "gpt2"), CompressOptions(rank=16, output=tmp_path / "out", plots=False))
    ids = torch.randint(0, 60, (2, 9))
    offloaded = load_offloaded(tmp_path / "out", AutoModelForCausalLM)
    assert all(p.is_meta for p in offloaded.parameters())  # nothing held between forward passes
    whole = load_model(tmp_path / "out", AutoModelForCausalLM, dtype=torch.float32)
    with torch.no_grad():
        measured = offloaded(ids)
        assert torch.allclose(measured.logits, whole(ids).logits, atol=1e-5)
    # nor during one: a KV cache would hold every block's keys and values to the end of the pass
    assert measured.cache is None


def test_calibrated_compress_leaves_no_scratch_behind(tiny_bert, calibration_file, tmp_path):
    """The block-at-a-time run keeps activations, statistics and fits in the staging folder; none of it ships."""
    from collab_convert import CompressOptions, compress

    result = compress(str(tiny_bert), CompressOptions(rank=16, output=tmp_path / "out", calibration=calibration_file,
                                                      calibration_samples=16, refine_steps=5, plots=False))
    assert result.layers[0].refinement is not None and result.fidelity is not None
    assert not any(p.name.startswith(".") for p in (tmp_path / "out").iterdir())
    assert [p.name for p in tmp_path.iterdir() if "collab-tmp" in p.name] == []


def _shared_key_records(name, tmp_path, monkeypatch, scratches=(None, "scratch"), keep=3):
    """The shared-key capture's records of a tiny model, from whole passes (None) and a block at a time."""
    from collab_convert.integration.shared_key_capture import collect_shared_key_statistics
    from collab_convert.forms.shared_key.statistics import geometry_of
    from collab_convert.format import HeadCounts
    from fixtures.models import ROTARY_CASES, build_rotary

    monkeypatch.setattr(model_runs, "calibration_tokenizer", lambda folder: CharacterTokenizer())
    monkeypatch.setattr(batching, "BATCH_SEQUENCES", 5)  # several batches, as above
    if name.endswith("-shared-key"):
        build_family(family_case(name.removesuffix("-shared-key")), tmp_path / name)
    else:
        build_rotary(next(case for case in ROTARY_CASES if case.name == name), tmp_path / name)
    source = open_model(str(tmp_path / name), "shared-key")
    try:
        layers = {layer.prefix: (geometry_of(layer), HeadCounts(layer.shape.num_heads, layer.kv_heads), layer.causal)
                  for layer in source.layers}
        return [collect_shared_key_statistics(source.folder, source.layout, source.family.position_bias, layers,
                                              SENTENCES[:10], max_length=40, keep_samples=keep,
                                              scratch=scratch and tmp_path / scratch)[0]
                for scratch in scratches], layers
    finally:
        source.close()


@pytest.mark.parametrize("name", ["llama", "qwen3", "mistral", "phi", "gpt_neox", "gpt2-shared-key"])
def test_rotary_records_a_block_at_a_time_equal_whole_passes(name, tmp_path, monkeypatch):
    """The shared-key capture (queries, keys and values from each module's own inputs, RoPE tables from its call;
    none for GPT-2's absolute positions) gives the same statistics and samples when the model runs a block at a
    time."""
    (whole, by_block), _ = _shared_key_records(name, tmp_path, monkeypatch)
    assert isinstance(by_block, SpillFolder)
    for prefix, expected in whole.items():
        record = by_block[prefix]
        for mine, theirs in zip(record.statistics._parts(), expected.statistics._parts(), strict=True):
            assert torch.allclose(mine, theirs, rtol=1e-4, atol=1e-5), prefix
        assert len(record.samples) == len(expected.samples) == 3
        assert torch.allclose(record.setting.cos, expected.setting.cos)
        assert record.setting.scaling == expected.setting.scaling


@pytest.mark.parametrize("name", ["llama", "phi", "gpt2-shared-key"])
def test_kept_samples_carry_the_attention_output_the_model_computed(name, tmp_path, monkeypatch):
    """The refinement's target, recorded from the output projection as the calibration pass runs it (its bias
    left out: GPT-2's c_proj has one), is what refinement would compute from the sample's queries, keys and
    values, so it need not compute it again. Every layer's samples have it, the last's too: its later batches
    stop after the module's output while they keep samples, not before the module runs."""
    from dataclasses import replace

    from collab_convert.decompose.shared_key import KeyRanks, slot_frequencies
    from collab_convert.decompose.shared_key_batches import StackedSequences

    (by_block,), layers = _shared_key_records(name, tmp_path, monkeypatch, scratches=("scratch",), keep=8)
    for prefix in layers:
        record, geometry = by_block[prefix], layers[prefix][0]
        assert len(record.samples) == 8 and all(s.target_output is not None for s in record.samples), prefix
        slots = slot_frequencies(KeyRanks.full(geometry))
        recorded = StackedSequences(record.samples, geometry, record.setting, slots, targets=True).target_output
        computed = StackedSequences([replace(s, target_output=None) for s in record.samples], geometry, record.setting,
                              slots, targets=True).target_output
        assert recorded.shape == computed.shape
        for row, sample in enumerate(record.samples):  # real positions: a step never draws the padding after them
            real = slice(0, sample.queries.shape[0])
            assert (recorded[row, real] - computed[row, real]).norm() < 3e-3 * computed[row, real].norm(), prefix


def test_a_block_keeps_one_heap_and_one_load_of_its_weights_for_all_its_batches(tmp_path, monkeypatch):
    """Per batch, accelerate read and converted the block's weights again, and each batch's activations were
    mapped and zeroed afresh: a block now holds both across its batches, keeps the heap's top between them (handed
    back after every tensor, it was faulted in again page by page), and hands the heap back when done."""
    from accelerate.hooks import AlignDevicesHook

    from collab_convert import cpu
    from fixtures.libc import RecordingLibc

    monkeypatch.setattr(model_runs, "calibration_tokenizer", lambda folder: CharacterTokenizer())
    monkeypatch.setattr(batching, "BATCH_SEQUENCES", 3)
    libc, loads = RecordingLibc(), []
    monkeypatch.setattr(cpu, "glibc", lambda: libc)
    onload = AlignDevicesHook._onload_weights
    monkeypatch.setattr(AlignDevicesHook, "_onload_weights",
                        lambda hook, module: loads.append(type(module).__name__) or onload(hook, module))
    folder = tmp_path / "gpt2"
    build_family(family_case("gpt2"), folder)
    statistics = _statistics(folder, scratch=tmp_path / "scratch")
    blocks = len(list(statistics))
    assert blocks > 1 and loads.count("GPT2Embedding") + loads.count("Embedding") > 1  # several batches ran
    assert loads.count("GPT2Block") == blocks
    assert libc.calls.count(("mallopt", cpu.HEAP_THRESHOLD)) == blocks
    assert [call for call in libc.calls if call[0] == "mallopt"][-1] == ("mallopt", cpu.MMAP_THRESHOLD)
    # a tiny checkpoint's blocks keep the floor's top (model_runs.kept_top)
    assert libc.trim_thresholds == [("mallopt", model_runs.KEPT_TOP_FLOOR), ("mallopt", cpu.TRIM_THRESHOLD)] * blocks


def test_a_block_keeps_a_larger_free_top_only_where_the_checkpoint_affords_it():
    """The free top kept between a block's batches is a sixteenth of the checkpoint: 24 MiB at least (SmolLM2's
    batches in a float32 pass free more than 16 MiB, which were faulted in again at every batch), enough for a
    0.5B-class checkpoint's feed-forward batches (tensors of 17.7 MB, freed in pairs), and at most the bound on the
    heap's growth for large ones."""
    assert model_runs.kept_top(100 << 20) == model_runs.KEPT_TOP_FLOOR == 24 << 20
    assert model_runs.kept_top(512 << 20) == 32 << 20
    assert model_runs.kept_top(771 << 20) >= 48 << 20
    assert model_runs.kept_top(8 << 30) == model_runs.FREE_HEAP_BOUND


def test_offloaded_bfloat16_model_keeps_its_head_small_and_its_math_float32(tmp_path, monkeypatch):
    """A bfloat16 checkpoint: blocks run in float32, the embedding table stays bfloat16, and the head computes in
    float32 from bfloat16 weight slices; the logits match a float32 load up to the bfloat16 embedding sum."""
    from transformers import AutoModelForCausalLM

    from collab_convert.integration import heads
    from collab_convert.integration.layerwise import load_offloaded
    from collab_convert.integration.loading import load_model

    model = build_family(family_case("gpt2"), tmp_path / "gpt2")
    model.to(torch.bfloat16).save_pretrained(tmp_path / "gpt2")
    offloaded = load_offloaded(tmp_path / "gpt2", AutoModelForCausalLM)
    assert offloaded.transformer.wte.weight.dtype == torch.bfloat16
    assert offloaded.transformer.h[0].attn.c_attn.weight.dtype == torch.float32
    whole = load_model(tmp_path / "gpt2", AutoModelForCausalLM, dtype=torch.float32)
    ids = torch.randint(0, 60, (2, 9))
    monkeypatch.setattr(heads, "SLICE_ROWS", 7)  # several slices of the 60-word head
    with torch.no_grad():
        mine, theirs = offloaded(ids).logits, whole(ids).logits
    assert mine.dtype == torch.float32
    assert (mine - theirs).abs().max() < 0.02 * theirs.abs().max()


@pytest.mark.parametrize("hidden_dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_a_bfloat16_heads_logits_are_float32_math_on_its_values(hidden_dtype, monkeypatch):
    """Where the states and the weight hold bfloat16 values, the head's float32 products may take them as
    bfloat16 (oneDNN's bf16 math mode, faster where the CPU has bfloat16 units): they lose nothing, and the
    process-wide setting is back as it was afterwards. States of other dtypes keep plain float32 products."""
    from collab_convert.integration import heads

    torch.manual_seed(0)
    head = torch.nn.Linear(96, 50, bias=False).to(torch.bfloat16)
    heads.float32_in_slices(head)
    monkeypatch.setattr(heads, "SLICE_ROWS", 16)  # several slices, the last one short
    hidden = (torch.randn(2, 5, 96) * 3).to(hidden_dtype)
    setting = torch.backends.mkldnn.matmul.fp32_precision
    logits = head(hidden)
    exact = hidden.double() @ head.weight.double().T
    assert logits.dtype == torch.float32
    assert (logits.double() - exact).abs().max() < 1e-5 * exact.abs().max()
    assert torch.backends.mkldnn.matmul.fp32_precision == setting


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status")
def test_a_head_read_from_its_shard_leaves_its_pages_as_it_converts_them(tmp_path, monkeypatch):
    """An offloaded head's weight is a view of its shard's mapping: its pages go slice by slice as they are
    converted (not the whole head resident until the call ends), and the logits are those of the weight in memory."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    from collab_convert.integration import heads
    from fixtures.resident import resident_file_bytes

    torch.manual_seed(0)
    save_file({"weight": torch.randn(8192, 256).to(torch.bfloat16)}, tmp_path / "head.safetensors")  # 4 MB
    mapped = safe_open(str(tmp_path / "head.safetensors"), framework="pt").get_tensor("weight")
    head, in_memory = (torch.nn.Linear(256, 8192, bias=False) for _ in range(2))
    head.weight, in_memory.weight = torch.nn.Parameter(mapped, False), torch.nn.Parameter(mapped.clone(), False)
    monkeypatch.setattr(heads, "SLICE_ROWS", 1024)
    for linear in (head, in_memory):
        heads.float32_in_slices(linear)
    hidden = torch.randn(1, 4, 256).to(torch.bfloat16)

    head(hidden)  # once first: the code pages its products touch the first time are resident after it
    float(mapped.float().sum())  # every page of the weight resident, as a plain read would leave it
    before = resident_file_bytes()
    logits = head(hidden)
    assert before - resident_file_bytes() > 3e6  # most of its 4 MB gone
    assert torch.equal(logits, in_memory(hidden))
    assert torch.equal(head.weight, in_memory.weight)


@pytest.mark.parametrize("by_block", [True, False])
def test_the_model_that_calibrated_is_freed_when_the_pass_ends(by_block, tmp_path, monkeypatch):
    """Its modules and hooks hold each other, so only the cycle collector frees them: the pass runs it, rather
    than leave a block's float32 weights (or the whole model) resident through every layer's refinement."""
    import gc
    import weakref

    from collab_convert.integration import layerwise

    monkeypatch.setattr(model_runs, "calibration_tokenizer", lambda folder: CharacterTokenizer())
    loaded = []
    if by_block:
        made = layerwise.BlockRunner.__init__

        def remembered(self, *args, **kwargs):
            made(self, *args, **kwargs)
            loaded.append(weakref.ref(self.model))

        monkeypatch.setattr(layerwise.BlockRunner, "__init__", remembered)
    else:
        whole = model_runs.whole_model
        monkeypatch.setattr(model_runs, "whole_model",
                            lambda *args: loaded.append(weakref.ref(model := whole(*args))) or model)
    folder = tmp_path / "gpt2"
    build_family(family_case("gpt2"), folder)
    gc.disable()  # the collector must not happen to run on its own in between
    try:
        _statistics(folder, scratch=tmp_path / "scratch" if by_block else None)
        assert len(loaded) == 1 and loaded[0]() is None
    finally:
        gc.enable()


@pytest.mark.parametrize("by_block", [True, False])
@pytest.mark.parametrize("native", [True, False])
def test_a_bfloat16_checkpoint_calibrates_in_bfloat16_where_the_device_multiplies_it(by_block, native, tmp_path,
                                                                                     monkeypatch):
    """The statistics come from the model as transformers runs it by default, in its own bfloat16, where the
    hardware multiplies bfloat16 (half a float32 pass's time); elsewhere in float32, which an emulated bfloat16
    pass would be slower than. Either way they are the float32 model's statistics up to bfloat16's rounding."""
    from collab_convert import devices
    from collab_convert.integration import layerwise

    monkeypatch.setattr(model_runs, "calibration_tokenizer", lambda folder: CharacterTokenizer())
    monkeypatch.setattr(devices, "training_products", lambda device: torch.bfloat16 if native else torch.float32)
    model = build_family(family_case("gpt2"), tmp_path / "gpt2")
    model.save_pretrained(tmp_path / "gpt2-f32")
    model.to(torch.bfloat16).save_pretrained(tmp_path / "gpt2")
    seen = []
    if by_block:
        made = layerwise.BlockRunner.__init__

        def remembered(self, *args, **kwargs):
            made(self, *args, **kwargs)
            seen.extend(devices.floating_dtype(block) for block, _ in self.blocks)

        monkeypatch.setattr(layerwise.BlockRunner, "__init__", remembered)
    else:
        whole = model_runs.whole_model
        monkeypatch.setattr(model_runs, "whole_model",
                            lambda *args: seen.append(devices.floating_dtype(model := whole(*args))) or model)
    scratch = (lambda name: tmp_path / f"scratch-{name}") if by_block else (lambda name: None)
    mine = _statistics(tmp_path / "gpt2", scratch=scratch("bf16"))
    assert seen and set(seen) == {torch.bfloat16 if native else torch.float32}
    theirs = _statistics(tmp_path / "gpt2-f32", scratch=scratch("f32"))
    for prefix in theirs:
        for side in ("query", "key"):
            a, b = getattr(mine[prefix], side).covariance, getattr(theirs[prefix], side).covariance
            assert (a - b).norm() < 0.05 * b.norm(), (prefix, side)  # measured: 0.2-2.6% in bfloat16


@pytest.mark.parametrize("name, form", [("albert", "collaborative"), ("t5", "collaborative"),
                                        ("llama", "shared-key")])
def test_a_bfloat16_pass_fits_as_well_as_a_float32_one(name, form, tmp_path, monkeypatch):
    """End to end, through whole passes (ALBERT's shared layer, T5's two stacks and position bias) and a block
    at a time (a rotary decoder): the fit from the bfloat16 pass errs as the float32 pass's does."""
    from collab_convert import CompressOptions, compress, devices
    from collab_convert.integration.loading import load_model
    from fixtures.models import ROTARY_CASES, build_rotary

    monkeypatch.setattr(model_runs, "calibration_tokenizer", lambda folder: CharacterTokenizer())
    monkeypatch.setattr("collab_convert.predict.can_measure", lambda source: False)  # no real tokenizer here
    rotary = next((case for case in ROTARY_CASES if case.name == name), None)
    model = build_rotary(rotary, tmp_path / name) if rotary else build_family(family_case(name), tmp_path / name)
    model.to(torch.bfloat16).save_pretrained(tmp_path / name)
    texts = tmp_path / "texts.txt"
    texts.write_text("\n".join(SENTENCES[:16]) + "\n")
    original = load_model(tmp_path / name, type(model), dtype=torch.float32)
    ids = torch.randint(3, 50, (2, 12))
    extra = {"decoder_input_ids": ids} if name == "t5" else {}
    errors = {}
    for products in (torch.float32, torch.bfloat16):
        monkeypatch.setattr(devices, "training_products", lambda device, products=products: products)
        budget = {"rank": 16} if form == "collaborative" else {"key_cache": 0.5}
        out = tmp_path / f"out-{products}"
        compress(str(tmp_path / name), CompressOptions(form=form, output=out, calibration=texts, refine_steps=5,
                                                       plots=False, **budget))
        with torch.no_grad():
            theirs = original(input_ids=ids, **extra)[0]
            mine = load_model(out, type(model), dtype=torch.float32)(input_ids=ids, **extra)[0]
        errors[products] = float((mine - theirs).norm() / theirs.norm())
    # measured: 7.9e-8 / 8.2e-8 (ALBERT), 0.1698 / 0.1701 (T5), 0.00732 / 0.00732 (Llama)
    assert errors[torch.bfloat16] <= 1.1 * errors[torch.float32] + 1e-4, errors
