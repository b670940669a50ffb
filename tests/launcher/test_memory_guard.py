"""The memory guard's estimate against the tiny checkpoint's own files, and its verdicts."""

from __future__ import annotations

import json
import struct

import pytest

from vllm_ling.options import LingOptionError
from vllm_ling.launcher import memory_guard as mg
from vllm_ling.launcher.memory_guard import GIB, DeviceMemory, MemoryEstimate


def shard_data_bytes(model_dir) -> int:
    """Bytes of tensor data in the shards: file size minus the 8-byte length and the header."""
    total = 0
    for shard in model_dir.glob("*.safetensors"):
        with open(shard, "rb") as f:
            (header_len,) = struct.unpack("<Q", f.read(8))
        total += shard.stat().st_size - 8 - header_len
    return total


@pytest.fixture(scope="module")
def config(tiny_checkpoint):
    return json.loads((tiny_checkpoint / "config.json").read_text())


def test_weights_as_stored_equal_the_shards_data(tiny_checkpoint, config):
    stored = mg.weight_bytes(tiny_checkpoint, config, device="cuda", fp8_head=False, mtp=True,
                             expert_copy=False, tensor_parallel_size=1)
    assert stored == shard_data_bytes(tiny_checkpoint)


def test_weights_after_the_load_transforms(tiny_checkpoint, config):
    from safetensors import safe_open

    tensors = {}
    for shard in tiny_checkpoint.glob("*.safetensors"):
        with safe_open(str(shard), "pt") as f:
            tensors.update({name: f.get_tensor(name) for name in f.keys()})

    def nbytes(t):
        return t.numel() * t.element_size()

    stored = sum(nbytes(t) for t in tensors.values())
    head = tensors["lm_head.weight"]
    experts = sum(nbytes(t) for n, t in tensors.items() if ".experts." in n)
    common = dict(mtp=True, tensor_parallel_size=1)
    # FP8 head: one byte per weight plus a BF16 scale per row, instead of BF16 weights.
    fp8_head = mg.weight_bytes(tiny_checkpoint, config, device="cuda", fp8_head=True,
                               expert_copy=False, **common)
    assert fp8_head == stored - nbytes(head) + head.numel() + head.shape[0] * 2
    # The decode copy doubles the routed experts.
    copy = mg.weight_bytes(tiny_checkpoint, config, device="cuda", fp8_head=False, expert_copy=True, **common)
    assert copy == stored + experts
    # CPU: dense FP8 weights become BF16 and lose their block scales.
    dense_fp8 = {n for n, t in tensors.items() if t.dtype == __import__("torch").float8_e4m3fn
                 and ".experts." not in n}
    scales = sum(nbytes(tensors[n + "_scale_inv"]) for n in dense_fp8)
    cpu = mg.weight_bytes(tiny_checkpoint, config, device="cpu", fp8_head=False, expert_copy=False, **common)
    assert cpu == stored + sum(tensors[n].numel() for n in dense_fp8) - scales
    # Without speculation the NEXTN layer is not loaded; tensor parallelism splits the rest.
    draft = f"model.layers.{config['num_hidden_layers']}."
    no_mtp = mg.weight_bytes(tiny_checkpoint, config, device="cuda", fp8_head=False, mtp=False,
                             expert_copy=False, tensor_parallel_size=2)
    assert no_mtp == (stored - sum(nbytes(t) for n, t in tensors.items() if n.startswith(draft))) // 2


def test_kv_and_state_scale_with_length_and_batch(config):
    one = mg.kv_and_state_bytes(config, max_model_len=1000, max_num_seqs=1, mtp=False, tensor_parallel_size=1)
    longer = mg.kv_and_state_bytes(config, max_model_len=2000, max_num_seqs=1, mtp=False, tensor_parallel_size=1)
    batch = mg.kv_and_state_bytes(config, max_model_len=1000, max_num_seqs=8, mtp=False, tensor_parallel_size=1)
    n_kda = sum(mg.is_kda_layer(i, config) for i in range(config["num_hidden_layers"]))
    n_mla = config["num_hidden_layers"] - n_kda
    kv_token = (config["kv_lora_rank"] + config["qk_rope_head_dim"]) * 2
    assert longer - one == n_mla * kv_token * 1000
    assert batch == 8 * one


def _drafter(config) -> dict:
    """A small DSpark drafter config for the tiny target: 2 layers of 4 heads x 32, block 8."""
    from vllm_ling.models.dspark_format import drafter_config

    return drafter_config(config, num_layers=2, num_heads=4, head_dim=32, block_size=8,
                          target_layer_ids=[0, 1], markov_rank=8, mask_token_id=1)


def test_speculation_keeps_a_kda_state_per_verify_position_and_the_drafter_counts(config):
    """vLLM keeps spec_tokens + 1 recurrent KDA states per sequence (a rejected draft rolls back to
    any of them) and a conv window spec_tokens longer; a DSpark drafter adds its own K/V per token and
    its weights (without the two vocabulary matrices it takes from the target)."""
    from vllm_ling.models.dspark_format import param_count, read_fields

    args = dict(max_model_len=1000, max_num_seqs=2, mtp=True, tensor_parallel_size=1)
    n_kda = sum(mg.is_kda_layer(i, config) for i in range(config["num_hidden_layers"]))
    h, d, w = config["num_attention_heads"], config["head_dim"], config.get("short_conv_kernel_size", 4) - 1
    plain, three = mg.kv_and_state_bytes(config, **args), mg.kv_and_state_bytes(config, **args, spec_tokens=3)
    assert three - plain == 2 * n_kda * (3 * h * d * d * 4 + 3 * h * d * 3 * 2)
    fields = read_fields(_drafter(config), "test")
    dspark = mg.kv_and_state_bytes(config, **args, spec_tokens=8, drafter=fields)
    nextn = config.get("num_nextn_predict_layers") or 0
    kv_token = (config["kv_lora_rank"] + config["qk_rope_head_dim"]) * 2
    eight = mg.kv_and_state_bytes(config, **args, spec_tokens=8)
    # the NEXTN layer's MLA KV goes, the drafter's 2 layers x K and V x 4 heads x 32 come
    assert dspark - eight == 2 * 1000 * (2 * 2 * fields.num_kv_heads * 32 * 2 - nextn * kv_token)
    assert mg.drafter_weight_bytes(fields, 2) == param_count(fields, shared=True) * 2 // 2


def _full_config() -> dict:
    from importlib import resources

    return json.loads(resources.files("vllm_ling").joinpath("data/ling3_flash_fp4_config.json").read_text())


LEASE_RUNS = "benchmarks/results/serve_h200_runs/lease-2026-12-06c"


@pytest.mark.parametrize("run, mtp, logged", [("ours", False, "9.89x"), ("ours-mtp", True, "5.40x")])
def test_cuda_kv_need_is_what_vllm_allocated_on_the_h100(run, mtp, logged):
    """Known answers from real vLLM: lease 2026-12-06c's full-size servers logged how many
    33,024-token sequences their KV cache holds ("Maximum concurrency ..."); the KV bytes they had
    over the guard's need for one sequence gives the same number. The byte model alone (MLA latents
    and KDA states, no pages) gave 27-31 % less."""
    import re
    from pathlib import Path

    repo = Path(__file__).resolve().parents[2]
    result = json.loads((repo / LEASE_RUNS / f"{run}.json").read_text())
    log = (repo / LEASE_RUNS / f"{run}-server.log").read_text(errors="replace")
    [(tokens, said)] = re.findall(r"Maximum concurrency for ([\d,]+) tokens per request: ([\d.]+x)", log)
    assert said == logged
    config = _full_config()
    args = dict(max_model_len=int(tokens.replace(",", "")), max_num_seqs=1, mtp=mtp, tensor_parallel_size=1,
                spec_tokens=3 if mtp else 0)
    need = mg.cuda_kv_and_state_bytes(config, **args)
    assert f"{result['memory']['kv_cache_bytes'] / need:.2f}x" == logged
    assert need > 1.25 * mg.kv_and_state_bytes(config, **args)


def test_the_cuda_need_grows_by_whole_pages_and_the_estimate_picks_it_on_cuda(tiny_checkpoint, config):
    """Pages: one more token past a block takes a whole page per MLA group slot; the KDA state pages
    do not grow with length; sequences multiply. The estimate uses it on CUDA, the byte model on CPU."""
    full = _full_config()
    args = dict(max_num_seqs=1, mtp=False, tensor_parallel_size=1)
    block_tokens = 1920  # the MLA block vLLM logged for the full size without MTP
    at_block = mg.cuda_kv_and_state_bytes(full, max_model_len=block_tokens, **args)
    assert mg.cuda_kv_and_state_bytes(full, max_model_len=1, **args) == at_block
    one_more = mg.cuda_kv_and_state_bytes(full, max_model_len=block_tokens + 1, **args)
    assert one_more - at_block == 7 * block_tokens * (512 + 64) * 2  # a page in each of the 7 slots of the MLA group
    assert mg.cuda_kv_and_state_bytes(full, max_model_len=4000, max_num_seqs=3, mtp=False,
                                      tensor_parallel_size=1) == 3 * mg.cuda_kv_and_state_bytes(
        full, max_model_len=4000, **args)
    common = dict(max_model_len=1000, max_num_seqs=2, mtp=True, spec_tokens=3)
    on_cuda = mg.estimate(tiny_checkpoint, config, device="cuda", **common)
    on_cpu = mg.estimate(tiny_checkpoint, config, device="cpu", **common)
    assert on_cuda.kv_and_state == mg.cuda_kv_and_state_bytes(config, tensor_parallel_size=1, **common)
    assert on_cpu.kv_and_state == mg.kv_and_state_bytes(config, tensor_parallel_size=1, **common)


def test_a_dspark_drafter_on_cuda_pads_the_groups_and_takes_its_own_pages():
    """With the full-size drafter (5 attention layers), 8 draft tokens: vLLM's block is 2176 tokens
    (dspark_blocks' docstring), the drafter's 144, and the groups shrink to 5 layers (the drafter's
    count), so the 7 MLA layers take 2 groups; a sequence of 33K needs about 4 GiB, 5x MTP's."""
    from importlib import resources

    from vllm_ling.models.dspark_format import read_fields

    full = _full_config()
    drafter = read_fields(json.loads(resources.files("vllm_ling").joinpath(
        "data/ling3_flash_dspark_config.json").read_text()), "test")
    args = dict(max_model_len=33024, max_num_seqs=1, mtp=True, tensor_parallel_size=1)
    dspark = mg.cuda_kv_and_state_bytes(full, **args, spec_tokens=8, drafter=drafter)
    mtp = mg.cuda_kv_and_state_bytes(full, **args, spec_tokens=3)
    page = 2176 * (512 + 64) * 2
    # KDA: 7 groups x (2 + 8) pages; MLA: 2 groups x 16 blocks; drafter: 1 group x ceil(33024 / 144)
    assert dspark == (7 * 10 + 2 * 16 + 230) * 5 * page
    assert 4.5 < dspark / mtp < 5.5


def test_serve_counts_the_speculation_it_will_run(tmp_path, config):
    from vllm_ling.cli.serve import speculation_for_memory

    base = {"mtp": "1", "drafter": None, "dspark_model": None, "num_spec_tokens": "3"}
    assert speculation_for_memory(base, 1) == (3, None)
    assert speculation_for_memory(base | {"mtp": "0"}, 1) == (0, None)
    assert speculation_for_memory(base, 2) == (0, None)  # vLLM 0.32 runs no draft under PP
    (tmp_path / "config.json").write_text(json.dumps(_drafter(config)))
    tokens, fields = speculation_for_memory(base | {"dspark_model": str(tmp_path)}, 1)
    assert tokens == 8 and fields.num_layers == 2
    # an unreadable drafter is P5's to refuse: the guard counts NEXTN's tokens meanwhile
    assert speculation_for_memory(base | {"dspark_model": str(tmp_path / "none")}, 1) == (3, None)


def fits(need_total_gib, available_gib, device="cpu", total_gib=100.0, unified=True, util=0.85):
    need = MemoryEstimate(weights=int(need_total_gib * GIB), kv_and_state=0, workspace=0,
                          max_model_len=1024, max_num_seqs=4)
    memory = DeviceMemory(available=int(available_gib * GIB), total=int(total_gib * GIB),
                          unified=unified, source="test")
    return mg.problems(need, memory, device, util)


def test_verdicts_name_the_numbers_and_flags():
    assert fits(10, 20) == []
    [message] = fits(30, 20)
    assert "30.00 GiB" in message and "20.00 GiB" in message and "--max-model-len" in message
    # A discrete GPU: the need must fit in vLLM's share.
    [message] = fits(90, 95, device="cuda", unified=False)
    assert "--gpu-memory-utilization 0.85" in message and "85.00 GiB" in message
    # Unified memory: vLLM's claim (85 GiB) plus the margin must fit in what is available.
    need = MemoryEstimate(weights=10 * GIB, kv_and_state=0, workspace=6 * GIB, max_model_len=1, max_num_seqs=1)
    memory = DeviceMemory(available=88 * GIB, total=100 * GIB, unified=True, source="test")
    [message] = mg.problems(need, memory, "cuda", 0.85)
    assert "lower --gpu-memory-utilization to at most 0.82" in message


def test_available_memory_override_and_sources():
    memory = mg.device_memory("cpu", {mg.ENV_AVAILABLE_OVERRIDE: "1.5"})
    assert memory.available == int(1.5 * GIB) and memory.source == mg.ENV_AVAILABLE_OVERRIDE
    real = mg.device_memory("cpu", {})
    assert 0 < real.available <= real.total and real.unified
    gb10 = mg.device_memory("cuda", {}, cuda_memory=lambda: (1 * GIB, 120 * GIB, True),
                            system_memory=lambda: (100 * GIB, 120 * GIB))
    assert gb10.available == 100 * GIB and gb10.unified  # not cudaMemGetInfo's figure
    h200 = mg.device_memory("cuda", {}, cuda_memory=lambda: (130 * GIB, 140 * GIB, False),
                            system_memory=lambda: (1 * GIB, 2 * GIB))
    assert h200.available == 130 * GIB and not h200.unified
    with pytest.raises(LingOptionError, match=mg.ENV_AVAILABLE_OVERRIDE):
        mg.device_memory("cpu", {mg.ENV_AVAILABLE_OVERRIDE: "lots"})
