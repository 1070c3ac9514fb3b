"""Models beyond geotrain's GPT: Hugging Face causal LMs, LoRA adapters, export.

Pure logic first (specs, adapters, the GPT-2 layout), then two CLI runs of 2 workers on loopback,
each exported and loaded back with transformers alone. Everything needs the ``hf`` extra
(transformers and peft), which ``make test`` installs.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch

from geotrain.models import ModelError, ModelSpec, build_model, model_context, trainable_count
from geotrain.plan.layers import layer_groups
from helpers import geotrain

HF = importlib.util.find_spec("transformers") is not None and importlib.util.find_spec("peft") is not None
needs_hf = pytest.mark.skipif(not HF, reason="needs the hf extra: pip install -e '.[hf]'")
LLAMA = "hidden_size=32,intermediate_size=64,num_hidden_layers=2,num_attention_heads=2,num_key_value_heads=2"


def _build(seed: int = 0, **spec) -> torch.nn.Module:
    torch.manual_seed(seed)
    return build_model(ModelSpec(**spec), 256, 32)


def test_gpt_config_overrides_resize_the_named_model():
    model = _build(model="tiny", model_config="n_layer=3,n_embd=32,n_head=4")
    assert len(model.blocks) == 3 and model.cfg.n_embd == 32 and model.block_size == 32
    with pytest.raises(ModelError, match="n_embd .* must be divisible by n_head"):
        _build(model="tiny", model_config="n_embd=30,n_head=4")


@needs_hf
def test_lora_trains_only_the_adapters_and_lora_fa_only_b():
    plain = _build(model="tiny")
    lora = _build(model="tiny", lora="r=4,alpha=8")
    trainable = {n for n, p in lora.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n for n in trainable)
    # 2 blocks x c_attn (64 -> 192): A is 4 x 64, B is 192 x 4
    assert sum(p.numel() for p in lora.parameters() if p.requires_grad) == 2 * (4 * 64 + 192 * 4)
    # the base is the model the same seed builds without adapters, and B = 0 leaves it unchanged
    x = torch.randint(0, 256, (2, 16))
    assert torch.equal(plain(x)[0], lora(x)[0])
    # counted on the meta device before any worker starts (the launcher's --chunk check): the
    # adapters alone, and a GPT's position embedding at the run's context
    adapters = trainable_count(ModelSpec(model="tiny", lora="r=4,alpha=8"), 256, None, 32)
    assert adapters == 2 * (4 * 64 + 192 * 4)
    counted, default = (trainable_count(ModelSpec(model="tiny"), 256, None, b) for b in (32, None))
    assert counted == sum(p.numel() for p in plain.parameters()) < default
    fa = _build(model="tiny", lora="r=4", lora_fa=True)
    assert {n.split(".lora_")[1].split(".")[0] for n, p in fa.named_parameters() if p.requires_grad} == {"B"}
    with pytest.raises(ModelError, match="no layer of that name"):
        _build(model="tiny", lora="r=4,targets=q_proj")


@needs_hf
def test_hf_model_from_a_config_speaks_the_gpt_interface_and_ties_count_once():
    model = _build(model="hf:gpt2", model_config="n_layer=2,n_embd=32,n_head=2")
    x = torch.randint(0, 256, (3, 32))
    logits, loss = model(x, x)
    assert logits.shape == (3, 32, 256) and model.block_size == 32
    expected = torch.nn.functional.cross_entropy(logits.view(-1, 256), x.view(-1))
    assert torch.equal(loss, expected)
    # GPT-2 ties its head to the embedding: one parameter, in one layer of a schedule
    params = [p for layer in layer_groups(model) for p in layer.params]
    assert len(params) == len({id(p) for p in params}) == len(list(model.parameters()))
    with pytest.raises(ValueError, match="exceeds"):
        model(torch.zeros(1, 33, dtype=torch.long))
    with pytest.raises(ModelError, match="neither a directory nor a model type"):
        model_context(ModelSpec(model="hf:not_a_type"), 256, 0)
    with pytest.raises(ModelError, match="no such directory"):
        model_context(ModelSpec(model="hf:/no/such/dir"), 256, 0)
    # a typo would otherwise build the type's default (a 7B llama), silently
    with pytest.raises(ModelError, match="hiden_size: not a field of hf:llama's config"):
        model_context(ModelSpec(model="hf:llama", model_config="hiden_size=64"), 256, 0)
    with pytest.raises(ModelError, match="--model-config"):  # a value the config refuses
        model_context(
            ModelSpec(model="hf:llama", model_config="hidden_size=30,num_attention_heads=4"), 256, 0
        )


@needs_hf
def test_a_saved_model_trains_in_train_mode_and_must_cover_the_datas_tokens(tmp_path):
    from transformers import GPT2Config, GPT2LMHeadModel

    GPT2LMHeadModel(
        GPT2Config(vocab_size=300, n_positions=32, n_embd=32, n_layer=1, n_head=2)
    ).save_pretrained(tmp_path / "m")
    model = build_model(ModelSpec(model=f"hf:{tmp_path / 'm'}"), 320, None, tokens=300)  # 320: rounded up
    assert model.hf.training and model.block_size == 32  # from_pretrained alone leaves it in eval
    with pytest.raises(ModelError, match="tokens go up to 300"):
        build_model(ModelSpec(model=f"hf:{tmp_path / 'm'}"), 320, None, tokens=301)


def _run(args: list[str], cwd: Path) -> None:
    proc = geotrain(args, timeout=240, cwd=cwd)
    assert proc.returncode == 0, proc.stderr[-3000:]


def _digest_rows(path: Path) -> dict[str, torch.Tensor]:
    return torch.load(path, map_location="cpu", weights_only=True)["model"]


@needs_hf
def test_a_trained_gpt_with_lora_exports_merged_to_gpt2_layout_with_the_same_logits(tmp_path):
    """geotrain's GPT, adapters trained (B moved off 0), written as a run's checkpoint: export
    merges them and writes GPT-2's layout, which transformers loads alone."""
    from transformers import AutoModelForCausalLM

    from geotrain.models import describe
    from geotrain.models.export import export, load_trained

    spec = ModelSpec(model="tiny", model_config="n_layer=2", lora="r=4")
    torch.manual_seed(0)
    model = build_model(spec, 256, 48)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.1)
    run = tmp_path / "run"
    run.mkdir()
    ckpt = {"model": model.state_dict(), "model_spec": describe(model, spec), "train_config": {"steps": 3}}
    torch.save(ckpt, run / "checkpoint.pt")
    record = export(run, tmp_path / "out")
    assert record["lora_merged"] and record["parameters"] == sum(
        p.numel() for n, p in model.named_parameters() if "lora_" not in n
    )
    ours, _, _ = load_trained(run)
    theirs = AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    x = torch.randint(0, 256, (2, 48))
    with torch.no_grad():
        expected = model.eval()(x)[0]
        assert torch.equal(ours(x)[0], expected)
        torch.testing.assert_close(theirs(input_ids=x).logits, expected, rtol=1e-5, atol=1e-5)


def _tokenizer_and_text(tmp_path: Path) -> tuple[Path, Path, list[str]]:
    """A small BPE tokenizer (tokenizers) trained here, and a JSON-lines file of documents."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    from geotrain.data.corpus import stdlib_files

    docs = [f.read_text(errors="replace")[:3000] for f in stdlib_files()[:60]]
    tokenizer = Tokenizer(models.BPE(unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["[UNK]", "<|endoftext|>"])
    tokenizer.train_from_iterator(docs, trainer)
    tokenizer.save(str(tmp_path / "tokenizer.json"))
    text = tmp_path / "docs.jsonl"
    text.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    return tmp_path / "tokenizer.json", text, docs


@needs_hf
def test_text_is_tokenized_once_with_the_given_tokenizer_and_cached_beside_it(tmp_path):
    from tokenizers import Tokenizer

    from geotrain.data.corpus import DataError, load_corpus

    tok_path, text, docs = _tokenizer_and_text(tmp_path)
    corpus = load_corpus(str(text), str(tok_path))
    tokenizer = Tokenizer.from_file(str(tok_path))
    eos = tokenizer.token_to_id("<|endoftext|>")
    expected = [i for d in docs for i in [*tokenizer.encode(d, add_special_tokens=False).ids, eos]]
    got = [*map(int, corpus.train), *map(int, corpus.val)]
    assert got == expected
    assert corpus.tokens == tokenizer.get_vocab_size() and corpus.vocab_size % 64 == 0
    (cache,) = tmp_path.glob("docs.jsonl.*.bin")
    stamp = cache.stat().st_mtime_ns
    assert len(load_corpus(str(text), str(tok_path)).train) == len(corpus.train)
    assert cache.stat().st_mtime_ns == stamp  # read from the cache, not tokenized again
    (tmp_path / "bad.jsonl").write_text('{"body": "no text field"}\n')
    with pytest.raises(DataError, match="a record needs a string field 'text'"):
        load_corpus(str(tmp_path / "bad.jsonl"), str(tok_path))
    with pytest.raises(DataError, match="no tokenizer.json"):
        load_corpus(str(text), str(tmp_path / "nowhere"))


@needs_hf
@pytest.mark.usefixtures("no_leftovers")
def test_hf_llama_with_lora_fa_under_dreamddp_runs_and_exports(tmp_path):
    from transformers import AutoModelForCausalLM

    from geotrain.data.corpus import load_corpus
    from geotrain.models.export import load_trained

    tok_path, text, _ = _tokenizer_and_text(tmp_path)  # its own tokenizer, on JSON lines
    run = tmp_path / "run"
    job = ["run", "--workers", "2", "--no-netem", "--steps", "8", "--batch-size", "4", "--block-size", "32"]
    job += ["--data", str(text), "--tokenizer", str(tok_path)]
    model = [
        "--model",
        "hf:llama",
        "--model-config",
        LLAMA,
        "--lora",
        "r=4,targets=q_proj,v_proj",
        "--lora-fa",
    ]
    # --lr-scale 1: no noise measure (its 1 KB exchange a period would hide the layers' bytes)
    algo = ["--algo", "dreamddp", "--H", "4", "--replan-threshold", "0", "--lr-scale", "1"]
    _run([*job, *model, *algo, "--no-progress", "--run-dir", str(run)], tmp_path)
    summary = json.loads((run / "summary.json").read_text())
    # LoRA-FA: only B trains, for q and v of 2 layers (32 x 4 each)
    assert summary["trainable_parameters"] == 2 * 2 * 32 * 4
    assert summary["lora"].startswith("LoRA-FA") and summary["model"] == "hf:llama"
    # DreamDDP plans over the 4 adapter layers: each step sends some of them (512 bytes each, on
    # 2 workers once), every one of them once a period; no base layer (4 KB and up) ever travels
    rows = [json.loads(line) for line in (run / "metrics" / "rank0.jsonl").read_text().splitlines()]
    sent = [r["sent_bytes"] for r in rows if "sent_bytes" in r]
    assert len(sent) == 8 and all(0 < b <= 4 * 512 and b % 512 == 0 for b in sent), sent
    assert sum(sent[:4]) >= 4 * 512
    # the frozen base is the model the seed built, bitwise
    torch.manual_seed(0)
    corpus = load_corpus(str(text), str(tok_path))
    base = build_model(ModelSpec(model="hf:llama", model_config=LLAMA), corpus.vocab_size, 32).state_dict()
    trained = _digest_rows(run / "checkpoint.pt")
    for name, value in base.items():
        key = name if name in trained else name.replace(".weight", ".base_layer.weight")
        assert torch.equal(trained[key], value), name
    out = tmp_path / "export"
    _run(["export", str(run), "--to", str(out)], tmp_path)
    ours, _, _ = load_trained(run)
    theirs = AutoModelForCausalLM.from_pretrained(out).eval()
    x = torch.randint(0, 400, (2, 32))
    with torch.no_grad():
        torch.testing.assert_close(theirs(input_ids=x).logits, ours(x)[0], rtol=1e-5, atol=1e-5)


def test_export_refuses_a_directory_without_a_checkpoint(tmp_path):
    from helpers import refused

    line = refused(["export", str(tmp_path), "--to", str(tmp_path / "out")])
    assert "no checkpoint.pt" in line
