"""fitter.session.swap and `ggfit router --llama-swap FILE`: a llama-swap config's cmds read as llama-server flags, its
groups (swap / exclusive / persistent) and what they keep resident together, sized as `ggfit router` sizes a preset."""

from __future__ import annotations

import json

import pytest

import cli
from fitter.session.router import PresetError, Resident, read_preset
from fitter.session.swap import SwapGroup, group_bytes, read_swap, worst_resident
from tests.synth import build

MIB = 2**20


def _write(tmp_path, gemma, llama) -> str:
    p = tmp_path / "swap.yaml"
    p.write_text(f"""macros:
  server: /opt/llama-server --port ${{PORT}} --no-repack
  model-dir: {tmp_path}
models:
  gemma:
    cmd: |
      ${{server}}
      # a comment line, dropped
      -m {gemma} \\
      -c 4096 --cache-ram=64 -np 1
    ttl: 60
  llama:
    cmd: ${{server}} --model {llama} --ctx-size 2048 --no-cache-idle-slots --alias ${{MODEL_ID}}
    unlisted: true
  gemma2:
    cmd: ${{server}} -m {gemma} -c 8192 -cram 0
groups:
  pair:
    swap: false
    exclusive: false
    members: [gemma, llama]
""")
    return str(p)


def test_a_swap_cmd_reads_as_the_same_preset(tmp_path, gemma):
    llama = str(build("llama"))
    conf = read_swap(_write(tmp_path, gemma, llama))
    by = {m.name: m for m in conf.models}
    assert by["gemma"].model == gemma and by["llama"].model == llama
    assert by["gemma"].args == ["--port", "5800", "--no-repack", "-c", "4096", "--cache-ram", "64", "-np", "1"]
    assert by["llama"].args[-2:] == ["--alias", "llama"]  # ${MODEL_ID} is the model's name
    assert conf.unlisted == ["llama"] and conf.ttl == {"gemma": 60}
    pair, default = conf.groups
    assert (pair.members, pair.swap, pair.exclusive) == (["gemma", "llama"], False, False)
    assert (default.name, default.members, default.swap, default.exclusive) == ("(default)", ["gemma2"], True, True)
    ini = tmp_path / "p.ini"  # the same flags through a router preset: the same sizes
    ini.write_text(f"[gemma]\nmodel = {gemma}\nport = 5800\nno-repack = true\nc = 4096\ncache-ram = 64\nnp = 1\n")
    from fitter.ggml.backends import Backend
    from fitter.session.router import size_model

    assert size_model(by["gemma"], Backend.CPU) == size_model(read_preset(ini)[0], Backend.CPU)


def test_groups_resident_together():
    sized = {n: Resident(name=n, load_bytes=b, session_bytes=0, process_bytes=0)
             for n, b in (("a", 5), ("b", 4), ("c", 2), ("d", 3))}
    both = SwapGroup(name="g", members=["a", "b"], swap=False, exclusive=False)
    one = SwapGroup(name="h", members=["c", "d"])
    assert group_bytes(both, sized) == 9 and group_bytes(one, sized) == 3
    assert worst_resident([both, one], sized) == (12, ["g", "h"])  # a non-exclusive group stays beside the other
    ex = both.model_copy(update={"exclusive": True})
    assert worst_resident([ex, one], sized) == (9, ["g"])  # an exclusive group stops the other
    assert worst_resident([ex, one.model_copy(update={"persistent": True})], sized) == (12, ["h", "g"])


def test_router_llama_swap_says_which_groups_fit(tmp_path, gemma, capfd):
    path = _write(tmp_path, gemma, str(build("llama")))
    with pytest.raises(SystemExit) as e:
        cli.main(["router", "--llama-swap", path, "--budget", "100GiB", "--backend", "cpu", "--json"])
    out = json.loads(capfd.readouterr().out)
    assert e.value.code == 0 and out["fits"]
    by = {m["name"]: m for m in out["models"]}
    pair = out["groups"][0]
    assert pair["bytes"] == by["gemma"]["bytes"] + by["llama"]["bytes"]
    assert out["worst_resident_bytes"] == pair["bytes"] + by["gemma2"]["bytes"]  # the pair stays beside gemma2
    tight = (pair["bytes"] - 1) // MIB
    with pytest.raises(SystemExit) as e:
        cli.main(["router", "--llama-swap", path, "--budget", f"{tight}MiB", "--backend", "cpu"])
    text = capfd.readouterr().out
    assert e.value.code == 1 and "group pair: gemma, llama: all resident together (swap: false)" in text
    assert "does NOT fit" in text


@pytest.mark.parametrize("body, says", [
    ("models: [1, 2]\n", "no models: map"),
    ("models:\n  a:\n    ttl: 5\n", "model a: no cmd"),
    ("models:\n  a:\n    cmd: llama-server -hf x/y\n", "downloads the model"),
    ("models:\n  a:\n    cmd: llama-server -m /m.gguf --port ${NOPE}\n", "unknown macro ${NOPE}"),
    ("models:\n  a:\n    cmd: llama-server -m /m.gguf\ngroups:\n  g:\n    members: [b]\n", "member b is not a model"),
    ("models: {a: [\n", "not YAML"),
])
def test_a_bad_swap_config_is_one_line(tmp_path, body, says, capfd):
    p = tmp_path / "bad.yaml"
    p.write_text(body)
    with pytest.raises(PresetError, match=says.replace("$", r"\$").replace("{", r"\{")):
        read_swap(p)
    with pytest.raises(SystemExit) as e:
        cli.main(["router", "--llama-swap", str(p), "--backend", "cpu"])
    err = capfd.readouterr().err
    assert e.value.code == 2 and says in err and "Traceback" not in err


def test_router_takes_one_file(capfd):
    with pytest.raises(SystemExit) as e:
        cli.main(["router"])
    assert e.value.code == 2 and "one of --models-preset FILE or --llama-swap FILE" in capfd.readouterr().err
