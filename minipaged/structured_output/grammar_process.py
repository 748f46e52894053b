"""Grammar masks filled in a process of their own, for async scheduling on a GPU (lesson 12).

`background.py` fills the masks on a thread of the engine's process, but the thread shares the
GIL with the main thread, and the main thread still advances the matchers (a few microseconds
a row, in xgrammar's C++) and waits until the worker has taken the GIL: measured on the H200's
host, about 0.3 ms of every constrained step of 64 rows, in a step of about 2 ms that the host,
not the GPU, decides. Here the matchers live in a child process (`grammar_worker.py`), which
accepts the tokens and fills the bitmask straight into memory both processes map (pinned for
the GPU's copy). The main thread only sends each step's new tokens and later reads a short
answer, two pipe writes and reads:

    step t     read tokens t-1; send each constrained row's new tokens (while the batch stays
               the same: just the tokens, "same"); append tokens t-1 (stop checks, outputs)
    child        accept the tokens, fill the rows' masks into the shared bitmask
    step t+1   schedule and build inputs; read the child's answer (rows filled, grammars
               ended, errors); sample step t with the masks, as background.py's steps do

The child knows sequences by id and remembers how many of each one's tokens its matcher has
accepted (`_has` mirrors it here), so a row it has not seen, or one whose tokens were taken
back, is sent all its tokens and a fresh matcher. Until the child has started (its xgrammar
import takes seconds), and for good if it fails or dies, the thread fills instead
(`BackgroundFill`; the engine's own matchers catch up from the sequences' tokens, so nothing is
lost): a step whose answer never comes is filled on the main thread from the tokens appended
since. `EngineConfig.structured_outputs_process` chooses this room (auto: with async scheduling
on CUDA).
"""
from __future__ import annotations

import logging
import os
import subprocess
import sys
import tempfile
import threading
import weakref
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Optional, Sequence as Seq

import torch

from minipaged.engine.sequence import Sequence
from minipaged.structured_output.background import BackgroundFill, FillResult
from minipaged.structured_output.manager import rejected_token

logger = logging.getLogger(__name__)
ANSWER_TIMEOUT_S = 60.0  # a child silent this long is taken for hung: the thread takes over


class ProcessJob:
    """One step's fill in the child: `result()` reads the answer (once)."""

    def __init__(self, owner: "ProcessFill", seqs: Seq[Sequence], rows: list[int], pin: bool):
        self.owner, self.seqs, self.rows, self.pin = owner, seqs, rows, pin
        self._result: Optional[FillResult] = None

    def result(self) -> FillResult:
        if self._result is None:
            self._result = self.owner._answer(self)
        return self._result


class ProcessFill:
    """`BackgroundFill`'s interface (`start`, `wait`), the fill done by a child process."""

    def __init__(self, manager, pin: bool, command: Optional[list[str]] = None):
        self.manager = manager
        self.pin = pin  # the bitmask is copied to a GPU: page-lock the shared memory
        self.thread = BackgroundFill(manager)  # until the child is ready, or if it fails
        self.command = command or [sys.executable, "-m",
                                   "minipaged.structured_output.grammar_worker"]
        self.state = "idle"  # -> "starting" -> "ready"; or "failed" (the thread from then on)
        self.process_steps = 0  # steps the child filled (tests, benchmarks)
        self.thread_steps = 0  # ... and steps the thread filled
        self._launcher: Optional[threading.Thread] = None
        self._proc: Optional[subprocess.Popen] = None
        self._send: Optional[Connection] = None
        self._recv: Optional[Connection] = None
        self._bitmask: Optional[torch.Tensor] = None  # mapped from the shared file
        self._pinned = False
        self._has: dict[int, int] = {}  # seq_id -> output tokens the child's matcher accepted
        self._seqs: dict[int, Sequence] = {}  # ... and the sequence (to drop it once finished)
        self._grammar_ids: dict[tuple, int] = {}  # (kind, spec, whitespace) -> id in the child
        self._plan: Optional[tuple] = None  # (seqs, rows): the last step's, all filled
        self._last: Optional[ProcessJob] = None

    # --- the child --------------------------------------------------------------------------
    def _launch(self) -> None:
        """On a helper thread: share the bitmask, start the child, wait until it is ready."""
        pin = self.pin
        try:
            mgr = self.manager
            mgr._xgr()
            rows, words = mgr.max_num_seqs, (mgr.vocab_size + 31) // 32
            where = "/dev/shm" if os.path.isdir("/dev/shm") else None
            fd, bitmask_path = tempfile.mkstemp(prefix="minipaged-bitmask-", dir=where)
            with os.fdopen(fd, "r+b") as f:
                f.truncate(rows * words * 4)
                import mmap
                shared = mmap.mmap(f.fileno(), rows * words * 4)
            bitmask = torch.frombuffer(shared, dtype=torch.int32).view(rows, words)
            bitmask.fill_(-1)
            if pin:  # page-locked in place (for every GPU), so that its copy does not wait
                cudart = torch.cuda.cudart()
                code = cudart.cudaHostRegister(bitmask.data_ptr(), rows * words * 4, 1)
                if int(code) != 0:
                    raise RuntimeError(f"cudaHostRegister of the shared bitmask failed ({code})")
                if not bitmask.is_pinned():
                    cudart.cudaHostUnregister(bitmask.data_ptr())
                    raise RuntimeError("the shared bitmask is not pinned once registered")
                self._pinned = True
            fd, info_path = tempfile.mkstemp(prefix="minipaged-tokenizer-", suffix=".json")
            with os.fdopen(fd, "w") as f:
                f.write(mgr.tokenizer_info.serialize_json())
            package_root = str(Path(__file__).resolve().parents[2])
            env = dict(os.environ, PYTHONPATH=os.pathsep.join(
                [package_root, *filter(None, [os.environ.get("PYTHONPATH")])]))
            proc = subprocess.Popen(self.command, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                    env=env)
            send = Connection(os.dup(proc.stdin.fileno()), readable=False)
            recv = Connection(os.dup(proc.stdout.fileno()), writable=False)
            proc.stdin.close()
            proc.stdout.close()
            self._proc, self._send, self._recv = proc, send, recv
            weakref.finalize(self, _stop_child, proc, send, recv,
                             bitmask.data_ptr() if self._pinned else None, shared)
            send.send(("init", info_path, bitmask_path, rows, words, sorted(mgr.stop_ids),
                       mgr.max_threads))
            if not recv.poll(ANSWER_TIMEOUT_S) or recv.recv() != ("ready",):
                raise RuntimeError("the grammar process did not start")
            os.unlink(bitmask_path)  # both have it mapped
            self._bitmask = bitmask
            self.state = "ready"
        except Exception as exc:  # noqa: BLE001 (the thread fills instead)
            logger.warning("structured outputs: no grammar process (%s); masks are filled on "
                           "a thread", exc)
            if self._proc is not None and self._proc.poll() is None:
                self._proc.kill()
            self.state = "failed"

    def _usable(self) -> bool:
        """Is the child ready (started on the first call; the thread fills meanwhile)?"""
        if self.state == "ready":
            return True
        if self.state == "idle":
            self.state = "starting"
            self._launcher = threading.Thread(target=self._launch, daemon=True,
                                              name="minipaged-grammar-launch")
            self._launcher.start()
        elif self.state == "starting" and not self._launcher.is_alive():
            return self.state == "ready"  # (it finished between the two reads)
        return False

    def ready(self, timeout: float = ANSWER_TIMEOUT_S) -> bool:
        """Start the child if it is not started, and wait until it is ready (or has failed):
        for a benchmark's or a test's first steps, which would otherwise go to the thread."""
        self._usable()
        if self._launcher is not None:
            self._launcher.join(timeout)
        return self.state == "ready"

    def _fail(self, why: str) -> None:
        logger.warning("structured outputs: the grammar process stopped (%s); masks are "
                       "filled on a thread from now on", why)
        self.state = "failed"
        self._plan = None
        if self._proc is not None and self._proc.poll() is None:
            self._proc.kill()

    # --- each step --------------------------------------------------------------------------
    def start(self, seqs: Seq[Sequence], pin: bool, just_read: Optional[tuple] = None):
        """As `BackgroundFill.start`: the child accepts each constrained, unfinished row's new
        tokens (`just_read`'s too) and fills its row of the shared bitmask."""
        self.wait()
        mgr = self.manager
        if not self._usable():
            self.thread_steps += 1
            return self.thread.start(seqs, pin, just_read)
        if self.thread._last is not None or self.thread._plan is not None:
            self.thread.wait()  # switching from the thread: it is done with the buffers
            self.thread._plan = None
        if mgr._bitmask is not self._bitmask:
            mgr.use_bitmask(self._bitmask, pin)
        mgr.prepare_buffers(len(seqs), pin)  # (waits for the last copy out of the bitmask)
        plan, self._plan = self._plan, None
        try:
            if (plan is not None and just_read is not None and just_read[0].seqs is plan[0]
                    and seqs == plan[0] and mgr.stop_ids.isdisjoint(just_read[1])):
                rows, tokens = plan[1], just_read[1]
                self._send.send(("same", [tokens[i] for i in rows]))
                for i in rows:
                    self._has[seqs[i].seq_id] += 1
            else:
                rows = self._send_fill(seqs, just_read)
        except (OSError, EOFError) as exc:  # the child has gone: the thread takes this step
            self._fail(f"{type(exc).__name__}: {exc}")
            self.thread_steps += 1
            return self.thread.start(seqs, pin, just_read)
        job = self._last = ProcessJob(self, seqs, rows, pin)
        return job

    def _send_fill(self, seqs: Seq[Sequence], just_read: Optional[tuple]) -> list[int]:
        """Send each constrained row's tokens the child's matcher lacks; returns the rows."""
        row_of, tokens = ({}, None) if just_read is None else (just_read[0].row_of,
                                                                just_read[1])
        entries, grammars, rows = [], [], []
        for i, seq in enumerate(seqs):
            p = seq.sampling_params.structured_outputs
            if p is None or seq.is_finished:
                continue
            out = seq.output_token_ids
            j = row_of.get(seq.seq_id)
            new = [] if j is None else [tokens[j]]
            sid = seq.seq_id
            have = self._has.get(sid)
            if have is None or have > len(out):  # unknown there, or tokens were taken back
                key = (p.kind, p.spec, p.disable_any_whitespace)
                gid = self._grammar_ids.get(key)
                if gid is None:
                    gid = self._grammar_ids[key] = len(self._grammar_ids)
                    grammars.append((gid, *key))
                entries.append((i, sid, gid, True, out + new))
            else:
                entries.append((i, sid, None, False, out[have:] + new))
            self._has[sid] = len(out) + len(new)
            self._seqs[sid] = seq
            rows.append(i)
        drop = [sid for sid, s in self._seqs.items() if s.is_finished]
        for sid in drop:
            del self._has[sid], self._seqs[sid]
        self._send.send(("fill", entries, grammars, drop))
        return rows

    def _answer(self, job: ProcessJob) -> FillResult:
        """The child's answer to `job` (the step's rows by their sequences)."""
        seqs = job.seqs
        try:
            if not self._recv.poll(ANSWER_TIMEOUT_S):
                raise TimeoutError(f"no answer in {ANSWER_TIMEOUT_S:.0f} s")
            answer = self._recv.recv()
            if answer[0] != "filled":
                raise RuntimeError(answer[1] if len(answer) > 1 else answer)
        except Exception as exc:  # noqa: BLE001 (the child has gone or is lost)
            self._fail(f"{type(exc).__name__}: {exc}")
            return self._fill_here(job)
        self.process_steps += 1
        _, rows, ended_rows, errors = answer
        failed = []
        for row, token, detail in errors:
            seq = seqs[row]
            failed.append((seq, rejected_token(seq, token, detail) if token is not None
                           else RuntimeError(f"the grammar process: {detail}")))
        for i in [*ended_rows, *(row for row, _, _ in errors)]:  # their matchers are gone
            self._has.pop(seqs[i].seq_id, None)
            self._seqs.pop(seqs[i].seq_id, None)
        if not ended_rows and not errors:
            self._plan = (seqs, rows)
        return FillResult(rows, [seqs[i] for i in ended_rows], failed)

    def _fill_here(self, job: ProcessJob) -> FillResult:
        """A step the child did not answer, filled on this thread with the engine's matchers,
        caught up with the tokens appended since the step was handed over."""
        mgr = self.manager
        rows, ended, errors = [], [], []
        for i in job.rows:
            seq = job.seqs[i]
            if seq.is_finished:  # (its row is sampled in vain and dropped when read)
                continue
            try:
                st = mgr._state(seq)
                if st.matcher.is_terminated():
                    ended.append(seq)
                    continue
                st.matcher.fill_next_token_bitmask(mgr._bitmask, i)
                rows.append(i)
            except Exception as exc:  # this request's grammar: it fails alone
                errors.append((seq, exc))
        return FillResult(rows, ended, errors)

    def wait(self) -> None:
        """Until the last step's answer is read (the bitmask and the protocol are free)."""
        if self._last is not None:
            self._last.result()
            self._last = None
        self.thread.wait()


def _stop_child(proc: subprocess.Popen, send: Connection, recv: Connection,
                pinned_ptr: Optional[int], shared) -> None:
    """When the ProcessFill goes: close the child's stdin (it exits), unpin the bitmask."""
    for conn in (send, recv):
        try:
            conn.close()
        except OSError:
            pass
    try:
        proc.wait(timeout=2)
    except subprocess.TimeoutExpired:
        proc.kill()
    if pinned_ptr is not None:
        try:
            torch.cuda.synchronize()  # no copy out of it is left
            torch.cuda.cudart().cudaHostUnregister(pinned_ptr)
        except Exception:  # noqa: BLE001 (CUDA may be gone at exit)
            pass
    del shared
