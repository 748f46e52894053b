"""The command line as a user meets it (minipaged/cli/): every teaching error is one `error:` line
on stderr with exit status 2, `--debug` shows the traceback, the model is positional, `serve
--help` needs no serve extras and lists vLLM's flags, `--config FILE.yaml` works and the command
line overrides it. The commands run as subprocesses, as a user runs them."""
import os
import socket
import subprocess
import sys
import textwrap

import pytest
import torch

ENV = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}


def run(*args: str, env: dict = ENV, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "minipaged.cli", *args], capture_output=True,
                          text=True, env=env, timeout=timeout)


def one_error_line(r: subprocess.CompletedProcess) -> str:
    """The single `error:` line of a failed command (asserts there is nothing else)."""
    lines = r.stderr.splitlines()
    assert r.returncode == 2, (r.returncode, r.stderr)
    assert len(lines) == 1 and lines[0].startswith("error: "), r.stderr
    return lines[0]


@pytest.fixture
def busy_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield s.getsockname()[1]


@pytest.fixture
def blocked_fastapi(tmp_path):
    """An environment in which `import fastapi` fails, as where the serve extras are missing."""
    (tmp_path / "fastapi").mkdir()
    (tmp_path / "fastapi" / "__init__.py").write_text("raise ImportError('No module named fastapi')")
    return {**ENV, "PYTHONPATH": os.pathsep.join([str(tmp_path), ENV.get("PYTHONPATH", "")])}


# --- one line per mistake ------------------------------------------------------------------------
TEACHING_ERRORS = {
    "wrong model path": (["generate", "/no/such/model"], ["'/no/such/model'", "not a local folder"]),
    "kv cache too small": (["generate", "stories260K", "--kv-cache-memory", "1000"],
                           ["kv_cache_memory=1000", "Not even one block", "num_blocks >= 32",
                            "kv_cache_memory >= 655360"]),
    "max_model_len above the model's": (["generate", "--max-model-len", "4096"],
                                        ["max_model_len=4096", "max_position_embeddings=512"]),
    "bench --num-requests 0": (["bench", "--num-requests", "0"], ["--num-requests", ">= 1, got 0"]),
    "bench --num-requests -3": (["bench", "--num-requests", "-3"], ["--num-requests"]),
    "a flag argparse refuses": (["generate", "--max-tokens", "many"], ["--max-tokens", "'many'"]),
    "attention backend": (["generate", "--attention-backend", "flash"],
                          ["choose from auto, torch_ref, cpu, triton"]),
    "demo --num-requests 0": (["demo", "--num-requests", "0"], ["--num-requests"]),
    "unknown command": (["sevre"], ["unknown command 'sevre'", "serve"]),
    "--lora without its module": (["generate", "--enable-lora", "--lora", "sql"],
                                  ["--lora 'sql' is not one of the --lora-modules adapters",
                                   "give --lora-modules NAME=PATH"]),
    "--lora-modules without --enable-lora": (["chat", "--lora-modules", "sql=/x", "-q", "Hi"],
                                             ["--lora-modules needs --enable-lora"]),
    "--max-cpu-loras below --max-loras": (["generate", "--max-loras", "2", "--max-cpu-loras", "1"],
                                          ["max_cpu_loras must be None or an integer >= 2",
                                           "got 1"]),
}


@pytest.mark.parametrize("case", TEACHING_ERRORS)
def test_teaching_error_is_one_line_and_status_2(case):
    argv, fragments = TEACHING_ERRORS[case]
    line = one_error_line(run(*argv))
    for fragment in fragments:
        assert fragment in line, line


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a torch that sees no GPU")
@pytest.mark.parametrize("command", ["generate", "bench", "serve", "chat"])
def test_device_cuda_without_cuda_fails_before_loading(command):
    line = one_error_line(run(command, "--device", "cuda", "--port", "0")
                          if command == "serve" else run(command, "--device", "cuda"))
    assert "sees no CUDA GPU" in line and "--device cpu" in line


def test_serve_checks_the_port_before_loading(busy_port):
    line = one_error_line(run("serve", "stories260K", "--port", str(busy_port), "--device", "cpu"))
    assert f"port {busy_port}" in line and "already in use" in line and "--port" in line


def test_serve_engine_core_error_is_one_line():
    line = one_error_line(run("serve", "--max-model-len", "4096", "--device", "cpu",
                              "--port", "0"))  # raised in the engine-core process
    assert "max_position_embeddings=512" in line


def test_missing_serve_extras_give_the_install_line(blocked_fastapi):
    line = one_error_line(run("serve", "--port", "0", env=blocked_fastapi))
    assert "fastapi" in line and "pip install 'minipaged[serve]'" in line
    help_text = run("serve", "--help", env=blocked_fastapi)  # --help imports none of them
    assert help_text.returncode == 0 and "--allowed-origins" in help_text.stdout


def test_debug_shows_the_traceback():
    r = run("generate", "--max-model-len", "4096", "--debug")
    assert r.returncode == 1 and "Traceback (most recent call last)" in r.stderr
    assert "ValueError: max_model_len=4096" in r.stderr


def test_bad_yaml_key_is_one_line(tmp_path):
    cfg = tmp_path / "serve.yaml"
    cfg.write_text("max-model-lenn: 256\n")
    line = one_error_line(run("generate", "--config", str(cfg)))
    assert str(cfg) in line and "unknown key 'max-model-lenn'" in line and "max-model-len" in line
    cfg.write_text("enforce-eager: maybe\n")
    assert "expected true or false" in one_error_line(run("generate", "--config", str(cfg)))
    assert "no such file" in one_error_line(run("generate", "--config", str(tmp_path / "x.yaml")))


# --- the commands work -----------------------------------------------------------------------
def test_generate_takes_the_model_positionally():
    r = run("generate", "stories260K", "--max-tokens", "8")
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("Once upon a time") and "[8 tokens, finish_reason=length]" in r.stdout


def test_config_file_and_command_line_override(tmp_path):
    cfg = tmp_path / "gen.yaml"
    cfg.write_text(textwrap.dedent("""\
        model: stories260K
        max-tokens: 3
        max_model_len: 64            # the underscore spelling works too
        enable-prefix-caching: false
        prompt: [Tom had, Lily saw]
        """))
    from minipaged.cli.generate import make_parser
    a = make_parser().parse_args(["--config", str(cfg), "--max-tokens", "5"])
    assert (a.model, a.max_model_len, a.max_tokens) == ("stories260K", 64, 5)  # the flag wins
    assert a.enable_prefix_caching is False and a.prompt == ["Tom had", "Lily saw"]
    assert make_parser().parse_args(["--config", str(cfg)]).max_tokens == 3
    r = run("generate", "--config", str(cfg), "--max-tokens", "5")
    assert r.returncode == 0, r.stderr
    assert r.stdout.count("[5 tokens") == 2 and r.stdout.startswith("Tom had")


def test_serve_config_lists_and_flags(tmp_path):
    from minipaged.cli.serve import compat_notes, parse_args
    cfg = tmp_path / "serve.yaml"
    cfg.write_text("served-model-name: [tiny, stories]\nallowed-origins: ['http://a.test']\n"
                   "port: 9001\ndisable-log-requests: true\nkv-cache-dtype: fp8\n")
    a = parse_args(["--config", str(cfg), "--port", "9002"])
    assert a.served_model_name == ["tiny", "stories"] and a.allowed_origins == ["http://a.test"]
    assert a.port == 9002 and a.disable_log_requests and a.kv_cache_dtype == "fp8"
    a = parse_args(["--generation-config", "auto", "--response-role", "bot", "--swap-space", "2",
                    "--preemption-mode", "swap", "--max-logprobs", "5",
                    "--allowed-origins", "http://a.test,http://b.test"])
    assert (a.swap_space, a.preemption_mode, a.max_logprobs) == (2.0, "swap", 5)
    assert a.allowed_origins == ["http://a.test", "http://b.test"]
    notes = compat_notes(a)
    assert len(notes) == 2 and "--generation-config" in notes[0] and "'assistant'" in notes[1]


VLLM_FLAGS = ["--kv-cache-dtype", "--swap-space", "--preemption-mode", "--max-logprobs",
              "--generation-config", "--disable-log-requests", "--disable-log-stats",
              "--revision", "--download-dir", "--allowed-origins", "--root-path",
              "--ssl-keyfile", "--ssl-certfile", "--response-role", "--config",
              "--served-model-name", "--api-key", "--max-model-len", "--tensor-parallel-size"]


def test_serve_help_lists_the_vllm_flags():
    r = run("serve", "--help")
    assert r.returncode == 0
    for flag in VLLM_FLAGS:
        assert flag in r.stdout, flag
    assert "None" not in r.stdout.split("--attention-backend", 1)[1].split("\n", 1)[0]


def test_chat_quick_answers_once():
    r = run("chat", "stories260K", "-q", "Once upon a time", "--temperature", "0",
            "--max-tokens", "6")
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith(", there was a little")


@pytest.fixture(scope="module")
def lora_dir(tmp_path_factory):
    """A random rank-8 adapter for stories260K in PEFT's format (lora/random_adapter.py)."""
    import json
    from minipaged.lora.random_adapter import save_random_adapter
    from minipaged.models.config import ModelConfig
    from minipaged.models.loader import resolve_builtin
    cfg = ModelConfig.from_dict(json.load(open(resolve_builtin("stories260K") / "config.json")))
    return save_random_adapter(str(tmp_path_factory.mktemp("lora") / "tiny"), cfg, rank=8,
                               seed=3, std=0.3)


def test_generate_and_chat_run_a_lora_adapter(lora_dir):
    from minipaged import LLM, LoRARequest, SamplingParams
    llm = LLM("stories260K", enable_lora=True, device="cpu", num_blocks=64)
    params = SamplingParams(temperature=0, max_tokens=8)
    want, base = (llm.generate(["Once upon a time"], params, use_tqdm=False,
                               lora_request=lora)[0].outputs[0].text
                  for lora in (LoRARequest("tiny", 1, lora_dir), None))
    assert want != base
    lora = ["--enable-lora", "--max-tokens", "8", "--temperature", "0", "--lora", "tiny"]
    r = run("generate", "stories260K", *lora, "--lora-modules", f"tiny={lora_dir}")
    assert r.returncode == 0, r.stderr
    assert r.stdout == f"Once upon a time{want}\n[8 tokens, finish_reason=length, lora=tiny]\n"
    r = run("chat", "stories260K", "-q", "Once upon a time", *lora, "--lora-modules",
            f'{{"name": "tiny", "path": "{lora_dir}"}}')  # vLLM's JSON form
    assert r.returncode == 0, r.stderr
    assert r.stdout == want + "\n"


def test_ssl_flags_are_checked_before_loading(tmp_path):
    from minipaged.cli.errors import CLIError
    from minipaged.cli.serve_checks import check_ssl
    with pytest.raises(CLIError, match="go together"):
        check_ssl(str(tmp_path / "key.pem"), None)
    with pytest.raises(FileNotFoundError, match="--ssl-keyfile"):
        check_ssl(str(tmp_path / "key.pem"), str(tmp_path / "cert.pem"))
    (tmp_path / "key.pem").write_text("not a key")
    (tmp_path / "cert.pem").write_text("not a certificate")
    with pytest.raises(CLIError, match="do not make a TLS certificate"):
        check_ssl(str(tmp_path / "key.pem"), str(tmp_path / "cert.pem"))


def test_cors_from_allowed_origins():
    from starlette.testclient import TestClient

    from minipaged.cli.serve import build_app_from_args, parse_args
    app = build_app_from_args(parse_args(["stories260K", "--device", "cpu", "--num-blocks", "64",
                                          "--allowed-origins", '["http://a.test"]']),
                              in_process=True)
    preflight = {"Access-Control-Request-Method": "POST"}
    with TestClient(app) as client:
        ok = client.options("/v1/completions", headers={"Origin": "http://a.test", **preflight})
        other = client.options("/v1/completions", headers={"Origin": "http://b.test", **preflight})
    assert ok.status_code == 200 and ok.headers["access-control-allow-origin"] == "http://a.test"
    assert "access-control-allow-origin" not in other.headers


def test_stats_line_says_what_ran():
    from minipaged.cli.serve import StatsLogger
    before = {"minipaged:prompt_tokens_total": 100.0, "minipaged:generation_tokens_total": 50.0}
    now = {"minipaged:prompt_tokens_total": 300.0, "minipaged:generation_tokens_total": 1050.0,
           "minipaged:num_requests_running": 4.0, "minipaged:num_requests_waiting": 1.0,
           "minipaged:kv_cache_usage_perc": 0.25}
    line = StatsLogger.line(before, now, 10.0)
    assert "prompt 20.0 tok/s" in line and "generation 100.0 tok/s" in line
    assert "running 4 reqs" in line and "waiting 1 reqs" in line and "KV cache 25.0% used" in line
    assert StatsLogger.line(now, {**now, "minipaged:num_requests_running": 0.0,
                                  "minipaged:num_requests_waiting": 0.0}, 10.0) is None  # idle


def test_bench_table_names_the_batch_not_concurrency():
    from minipaged.lessons.bench import BenchResult, format_table, make_workload
    rows = [BenchResult("minipaged", 64, 37, 1.0, 64.0, 9000, 9000.0,
                        batch_limit="max_num_seqs=256"),
            BenchResult("hf-static", 64, 64, 2.0, 32.0, 9000, 4500.0, batch_limit="batch_size=64")]
    table = format_table(rows)
    header = table.splitlines()[0]
    assert "concurrency" not in header and "peak batch" in header and "batch limit" in header
    assert "| minipaged | 64 | 37 | max_num_seqs=256 |" in table and "2.00x" in table
    with pytest.raises(ValueError, match="num_requests must be at least 1"):
        make_workload("cpu", 512, num_requests=0)


def test_bench_reports_the_peak_batch_it_ran(tmp_path):
    import json
    out = tmp_path / "bench.json"
    r = run("bench", "stories260K", "--workload", "fixed", "--num-requests", "5", "--input-len",
            "4", "--output-len", "4", "--backends", "minipaged", "--max-num-seqs", "3",
            "--disable-tqdm", "--json", str(out))
    assert r.returncode == 0, r.stderr
    report = json.loads(out.read_text())
    result = report["results"][0]
    assert result["concurrency"] == 3 and result["batch_limit"] == "max_num_seqs=3"
    # warmed up untimed on the workload's shapes first, and said so
    assert report["warmup"]["minipaged"] == result["extra"]["warmup"]
    assert result["extra"]["warmup"]["output_tokens"] == 5 * 4 and "warm-up (untimed)" in r.stdout
    assert "| minipaged | 5 | 3 | max_num_seqs=3 |" in r.stdout
