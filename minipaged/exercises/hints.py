"""Three hints per stage (`minipaged exercise hint NAME` gives the next): first what to think
about, then the shape of the code and its traps, last something close to pseudocode."""
from __future__ import annotations

HINTS: dict[str, tuple[str, str, str]] = {
    "block_allocator": (
        "The free queue is an LRU list of blocks nobody references: a block freed last is "
        "handed out last, so the prefix it caches survives longest. A block's hash stays on "
        "it while it is free; only handing it out for new tokens evicts the hash.",
        "allocate pops the front (popitem(last=False)); decref at 0 appends at the back; "
        "incref of a block at 0 takes it out of the queue (a cache hit brings it back). Keep "
        "num_cached_free equal to the hashed blocks in the queue, in all three. lookup must "
        "compare tokens and key, not only the hash: equal hashes of different tokens are a miss.",
        "allocate: raise if the queue is empty; id = pop front; if block.block_hash is not None: "
        "_drop_hash, num_cached_free -= 1, num_evictions += 1; ref_count = 1.\n"
        "incref: if ref_count == 0: del free_queue[id], and if hashed num_cached_free -= 1; "
        "ref_count += 1.  decref: raise if ref_count <= 0; ref_count -= 1; at 0: "
        "free_queue[id] = None, and if hashed num_cached_free += 1.\n"
        "lookup: id = hash_to_block.get(h); None if missing or the block's token_ids / "
        "extra_key differ.  register: return if caching is off, the block has a hash, or h is "
        "indexed; else set hash, tokens, key and hash_to_block[h] = id.\n"
        "hash_block: hash((parent, tokens, key) if key else (parent, tokens))."),
    "block_manager": (
        "A block table is a list of physical block ids; everything else is counting. The "
        "prefix lookup reuses whole blocks only, and never the block holding the last token: "
        "its logits are needed to sample. Copy-on-write happens when a sequence is about to "
        "write into a block whose ref_count is above 1.",
        "get_computed_blocks walks tokens[:-1] in whole blocks (range(0, len - 1 - bs + 1, bs)), "
        "chaining each hash on the previous one. can_allocate / can_append count fresh blocks "
        "plus revived hits (ref_count 0) / the copy-on-write block. allocate and append_slots "
        "end by publishing what the step fills: cache_blocks(seq, total), which hashes only "
        "full blocks of known tokens past those already in _hashes. free calls "
        "cache_full_blocks(seq) before it drops the table, then decrefs in reverse.",
        "allocate: incref hits; table = hit ids + [allocator.allocate().block_id for the rest "
        "of num_blocks_for(cached + n)]; block_tables / num_block_refs += len / num_slots = "
        "total / _hashes = hits' hashes; seq.num_computed_tokens = cached (num_cached_tokens "
        "too if not seq.num_preemptions); prefix_queries += seq.num_tokens, prefix_hits += "
        "cached; first hit in self._uncomputed -> _uncomputed_hits[seq_id] = (seq, index); "
        "if publish: cache_blocks(seq, total).\n"
        "append_slots: idx = _needs_cow(seq); if idx is not None: dst = allocate(), "
        "decref(src), table[idx] = dst, copies.append((src, dst)); append blocks while "
        "len(table) < num_blocks_for(computed + n); num_slots = max(old, total); "
        "cache_blocks(seq, total); return copies.\n"
        "cache_blocks: known = min(num_tokens, seq.num_tokens); return if caching is off or "
        "known // bs <= len(hashes); for i in range(len(hashes), min(known // bs, len(table))): "
        "chunk = tokens of block i; h = hash_block(hashes[-1] or None, chunk, key); "
        "hashes.append(h); allocator.register(block, h, chunk, key); if (i + 1) * bs > "
        "num_computed_tokens and block.block_hash == h: _uncomputed[id] = (seq, i, h), "
        "_uncomputed_of[seq_id].append(id)."),
    "prepare_inputs": (
        "The model has no batch dimension: every new token of every scheduled sequence is laid "
        "end to end, and AttentionMetadata tells attention which tokens belong to whom "
        "(cu_seqlens_q) and where their keys live (block_tables, context_lens).",
        "For sequence s the new tokens are positions start .. start + n - 1 with start = "
        "s.seq.num_computed_tokens. A token at position p is written to slot "
        "block_table[p // bs] * bs + p % bs. context_len is start + n (this step's keys "
        "included). Only sequences with s.samples get a logits row: the index of their last "
        "token in the flat batch. Tables are padded with 0 to the widest.",
        "for s in sched.scheduled: start, n = ...; input_ids += token_ids[start:start+n] + "
        "s.spec_token_ids; positions += range(start, start+n); slot_mapping += [...]; "
        "query_lens.append(n); context_lens.append(start + n); if s.samples: sample_rows += "
        "range(len(input_ids) - 1 - len(s.spec_token_ids), len(input_ids)).\n"
        "width = max table length; tables padded with 0; cu_seqlens_q = [0] + running sums.\n"
        "AttentionMetadata(slot_mapping int64, block_tables int32, context_lens int32, "
        "cu_seqlens_q int32, query_lens, context_lens_host=context_lens, max_query_len, "
        "max_context_len, block_size=bs, num_decode_tokens=query_lens.count(1)); return "
        "(input_ids int64, positions int64, metadata, sample_rows)."),
    "step_loop": (
        "A step is five public phases of the engine, in order; the loop only calls them. The "
        "stop checks decide, after each new token, whether its sequence is finished.",
        "Time the step from its start (time.perf_counter()). An empty plan (sched.is_empty) "
        "still has to be finished (finish_empty_step). update_computed moves every scheduled "
        "sequence's num_computed_tokens on by its num_new_tokens and publishes its filled "
        "blocks; only sequences whose ScheduledSeq.samples is true sample. In check_stop, "
        "EOS and stop tokens count only once min_tokens are out; max_tokens and "
        "max_model_len give FINISHED_LENGTH.",
        "step: eng = self.engine; t0 = perf_counter(); sched = eng.schedule(); if empty: return "
        "eng.finish_empty_step(sched, t0); logits = eng.execute_model(sched); outputs, finished "
        "= eng.sample_and_process(logits, eng.update_computed(sched)); return "
        "eng.finish_step(sched, outputs, finished, t0).\n"
        "update_computed: for s in sched.scheduled: s.seq.num_computed_tokens += "
        "s.num_new_tokens; block_manager.cache_full_blocks(s.seq); return [s.seq ... if "
        "s.samples].\n"
        "check_stop: if n_out >= min_tokens: EOS (not ignore_eos) -> STOPPED; token in "
        "stop_token_ids -> stop_reason = token, STOPPED. if p.stop and check_stop_strings(seq): "
        "STOPPED. n_out >= max_tokens or num_tokens >= max_model_len: LENGTH. else None.\n"
        "find_stop_string: best = None; for stop: idx = text.find(stop, max(searched - "
        "len(stop) + 1, 0)); keep the smallest idx != -1; return (stop, idx + len(stop) if "
        "include else idx) or None."),
    "admission": (
        "Admission is the third step of a pass: what the running sequences left of the token "
        "budget goes to waiting sequences, oldest first. A step that had to preempt admits "
        "nobody: memory is short. A cached prefix costs blocks it already has and no budget.",
        "schedule: drop_uncomputed_blocks first; budget = _schedule_running(out, "
        "max_num_batched_tokens); admit only if not out.preempted; then set each plan's "
        "block_table. _admit_waiting: sequences can_admit refuses are put aside and go back to "
        "the front in order (extendleft(reversed(...))). admit returns None when seats, chunking "
        "or blocks say no, and leaves the queue untouched then.",
        "admit: if not has_seats([seq]): None; blocks, cached = get_computed_blocks(seq); n = "
        "num_tokens - cached; if n > budget: None without chunked prefill, else n = budget; if "
        "not can_allocate(seq, blocks, n): None; waiting.popleft(); allocate(seq, blocks, n); "
        "enter_running(seq); out.scheduled.append(ScheduledSeq(seq, n, True, "
        "num_computed_tokens + n == num_tokens, cached)); return n.\n"
        "_admit_waiting: while waiting and budget > 0: seq = waiting[0]; if not can_admit: "
        "skipped.append(popleft()); continue; n = admit(...); break if None; budget -= n."),
    "scheduler": (
        "Running sequences come first, decodes before prefill chunks. When the cache has no "
        "room, the most recently admitted running sequence is preempted: recompute frees its "
        "blocks and sends it back to the front of the waiting queue.",
        "Split self.running into decodes (not seq.is_prefill) and chunks, loop over decodes + "
        "chunks, stop when the budget is 0, skip a sequence preempted earlier in the loop. "
        "n = min(num_tokens_to_compute(seq), budget): it must not grow when a victim gives "
        "budget back. _preempt_last removes the victims' plans and pending copy-on-writes "
        "from `out` before it calls preempt.",
        "loop: while not can_append(seq, n): budget += _preempt_last(out); break if seq is no "
        "longer RUNNING; if still RUNNING: out.blocks_to_copy += append_slots(seq, n); "
        "out.scheduled.append(ScheduledSeq(seq, n, uncomputed > 1, n == uncomputed)); "
        "budget -= n.\n"
        "_preempt_last: victims = gang(running[-1]); leave_running + num_preemptions += 1 each; "
        "self.num_preemptions += 1; returned = their planned tokens, drop their plans; pending "
        "= {dst: src for copies whose dst is in their tables}, drop those copies; "
        "preempt(victims, out, pending); out.preempted += victims; return returned.\n"
        "preempt: free each, status WAITING, recompute_until = max(it, num_computed_tokens), "
        "num_computed_tokens = 0; waiting.extendleft(reversed(seqs)).\n"
        "finish: if RUNNING: leave_running(seq), else try waiting.remove(seq) (ValueError: it "
        "was not there); seq.status = status; block_manager.free(seq)."),
    "sampler": (
        "Every row is processed at once, even with different parameters: truncation is a "
        "mask on sorted logits, and sampling is an exponential race, argmax(p / E) with "
        "E ~ Exp(1), so a seeded row only needs its own noise.",
        "Sort each row descending once. top-k: rank >= k is removed (k = 0: the vocabulary). "
        "Then the probabilities of what top-k kept: top-p removes a token when the mass ranked "
        "above it already reaches top_p (and top_p < 1); min-p removes p < min_p * p_top. "
        "Never remove rank 0; scatter back with the sort order. In _sample: temperatures per "
        "row (1 for greedy rows), noise 1.0 for greedy rows, then the greedy rows' argmax.",
        "mask: sorted, order = logits.sort(-1, descending=True); ranks = arange(vocab); k = "
        "where(top_k > 0, top_k, vocab); remove = ranks >= k; probs = sorted.masked_fill(remove, "
        "-inf).softmax(-1); before = probs.cumsum(-1) - probs; remove |= (before >= top_p) & "
        "(top_p < 1); remove |= probs < min_p * probs[:, :1]; remove[:, 0] = False; scatter.\n"
        "_sample: scaled = logits / temps; if any truncation: the mask; probs = softmax; noise "
        "= exponential_ from the engine generator for unseeded rows, from seq.generator "
        "(manual_seed(seed + index), made once) for seeded rows, 1 for greedy; sampled = (probs "
        "/ noise).argmax(-1); greedy rows: where(greedy, logits.argmax(-1), sampled)."),
    "online_softmax": (
        "Walk the sequence's blocks in order and never hold the whole row of scores: keep a "
        "running max m, a running sum l of exp(score - m) and an accumulator of exp(score - m) "
        "* v; when the max grows, rescale both by exp(m_old - m_new).",
        "Only cdiv(context_len, block_size) blocks; the last one has fewer keys (read only "
        "those: the rest are NaN). Causal: key position k is visible to query t when k <= "
        "context_len - q_len + t. GQA: repeat_interleave each KV head group times. Work in "
        "fp32 and return q's dtype.",
        "qf = q.float().transpose(0, 1); q_pos = ctx - q_len + arange(q_len); m = -inf, l = 0, "
        "acc = 0.\nfor i in range(cdiv(ctx, bs)): b = block_table[i]; n = min(bs, ctx - i * "
        "bs); k, v = cache[b, :n] widened, repeated, (heads, n, dim); s = qf @ k^T * scale; "
        "mask k_pos > q_pos with -inf; m_new = max(m, s.amax(-1)); alpha = exp(m - m_new); p = "
        "exp(s - m_new); l = l * alpha + p.sum(-1); acc = acc * alpha + p @ v; m = m_new.\n"
        "return (acc / l).transpose(0, 1).to(q.dtype)."),
    "triton_attention": (
        "A Triton program works on whole tiles: one token's (heads x dims) tile for the store, "
        "a (BLOCK_N keys x dims) tile for the attention. Every address is base + offsets, and "
        "every lane that does not exist is masked (other=0.0 on loads).",
        "store: slot = load(slot_mapping + token) as int64; block = slot // BLOCK_SIZE, "
        "offset = slot % BLOCK_SIZE; mask = slot >= 0 & real heads & real dims. Key tile: "
        "offs_n = kv_start + arange(BLOCK_N); the block id of each key from the table row "
        "(cast to int64); row address = block * stride_c_block + (offs_n % BLOCK_SIZE) * "
        "stride_c_slot + kv_head * stride_c_head. The tile's max may still be -inf for a row "
        "that saw no key: subtract 0 instead, or exp2 gives NaN. The merge reads NUM_SPLITS "
        "partial results and log2-sum-exps per (token, head) and weights each by exp2(lse - "
        "max lse).",
        "store: dst = block * stride_c_block + offset * stride_c_slot + heads[:, None] * "
        "stride_c_head + dims[None, :]; store(k_cache + dst, load(k_src, mask), mask), same for "
        "v.\n"
        "tile: block_ids = load(table + offs_n // BLOCK_SIZE, mask=n_mask, other=0).to(int64); "
        "kv_ptrs = kv_offs[:, None] + offs_d[None, :]; k, v = load(..., mask, other=0.0); "
        "widen; s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale; if "
        "MASKED: s = where((offs_n <= q_pos[:, None]) & n_mask, s, -inf); m_new = maximum(m_i, "
        "max(s, 1)); m_safe = where(m_new == -inf, 0, m_new); p = exp2(s - m_safe[:, None]); "
        "alpha = exp2(m_i - m_safe); l_i = l_i * alpha + sum(p, 1); acc = acc * alpha[:, None] "
        "+ tl.dot(p.to(v.dtype), v, ...); return acc, l_i, m_new.\n"
        "merge: token = first_token + program_id(0) (int64); head = program_id(1); row = token "
        "* num_programs(1) + head; lse = load(lse_ptr + row * NUM_SPLITS + splits); m = "
        "max(lse), 0 where -inf; w = exp2(lse - m); part = load(partials, masked dims); total "
        "= sum(w), 1 where 0; store(out, sum(w[:, None] * part, 0) / total, masked dims)."),
    "fork": (
        "A request with n samples prefills its prompt once. When that sequence samples its "
        "first token, it becomes n sequences that share every block (ref counts + 1); the "
        "first write into the shared last block copies it.",
        "Sequence.fork copies the lists it owns (a child must not append to its parent's "
        "token_ids) and resets what is per-sample (generator, detok_stream). BlockManager.fork "
        "gives the child its own list of the same ids. GroupScheduling.fork releases the seats "
        "the prompt reserved (once per group) and puts the children in self.running right "
        "after the parent. split_groups repeats the parent's logits row for its children.",
        "fork_sequence: replace(self, seq_id=next(_seq_counter), index=index, generator=None, "
        "detok_stream=None, output_token_ids=list(...), token_ids=list(...), logprobs=None or a "
        "copy).\nfork_block_table: table = list(parent's); incref each; store it; "
        "num_block_refs += len; copy num_slots, _hashes (a new list), num_computed_tokens.\n"
        "fork_running: if not group.forked: num_reserved_seats -= size - 1; forked = True; "
        "block_manager.fork(parent, child) and status RUNNING for each; running[i+1:i+1] = "
        "children.\nsplit_groups: beams -> group.beam.logits[seq_id] = row clone, ready when "
        "all live beams have one; others -> rows/seqs, and an unforked group's seq forks: "
        "children = [seq.fork(i) for i in 1..size-1], scheduler.fork, group.seqs += children, "
        "rows += [row] * len(children)."),
    "beam_search": (
        "Each step scores every (beam, next token) pair by cumulative log-probability and "
        "keeps the best: 2k candidates so that k can go on even if k of them end. The KV cache "
        "follows the choice: a chosen parent is forked, a dropped beam is freed.",
        "HF's details decide the tokens: topk over the flattened (beams x vocab) scores; a "
        "hypothesis's length is the generated tokens including the EOS; scores are divided by "
        "gen_len ** length_penalty in float32; finished hypotheses sorted stably by score, at "
        "most k kept; early stopping False compares the best live beam at its current length "
        "(\"never\" with length_penalty > 0: at max_new_tokens).",
        "step: logprobs = logits.float().log_softmax(-1); scores = (logprobs + cum[:, None])"
        ".flatten(); K = min(max(2, 1 + len(eos)) * width, numel); top, idx = topk(K); parents, "
        "tokens = idx // vocab, idx % vocab; gen_len = num_output_tokens + 1; stops = at_max or "
        "token in eos; finished += stopping among the first width; sort, cut to width; live = "
        "[i not stopping][:width]; done = not live or (full and (early_stopping is True or not "
        "improvable)); return [Candidate(...) for live] or [].\n"
        "beam_step: logits = stack(beam.logits.pop(id) for beams); chosen = step(...); unchosen "
        "parents finish ABORTED; per parent: children = [parent.fork(num_created + k)], "
        "num_created += len, scheduler.fork, then each appends its token, cum_logprob, "
        "logprobs; group.seqs = the chosen in candidate order."),
    "rejection_sampler": (
        "Each guess x is accepted with probability min(1, p(x)/q(x)); at the first rejection "
        "one token is drawn from max(0, p - q) normalised, and if every guess is accepted a "
        "bonus token comes from the next position's p. That makes every emitted token follow "
        "p exactly.",
        "Compare all guesses at once: uniforms * q(x) < p(x) (n-gram guesses: q(x) = 1), or "
        "x == argmax p for greedy rows; AND with valid = position < num_draft_tokens, then "
        "cumprod finds the accepted prefix. The last token comes from position num_accepted. "
        "_correction_weights: p itself when all were accepted (or the residual is zero), else "
        "the residual at the rejected position (one-hot q: p with the guess zeroed).",
        "check shapes (ValueError 'target_probs must be ...'); valid = arange(k) < nd[:, None]; "
        "safe = drafts.clamp(min=0); accept = drafts == argmax p; if not all greedy: u, noise = "
        "_draws(...); p_x, q_x gathered at safe; accept = where(greedy, accept, u * q_x < p_x); "
        "accept &= valid; num_accepted = accept.long().cumprod(-1).sum(-1); p_last = p[rows, "
        "num_accepted]; token = argmax, or (weights / noise).argmax for sampled rows; output = "
        "full(-1); accepted drafts, then output[rows, num_accepted] = token.\n"
        "_draws: check len(generators); uniforms = rand((rows, max_k), generator); noise = "
        "empty((rows, vocab)).exponential_(generator); for each seeded row r: its first "
        "num_draft_tokens[r] uniforms and its noise row again from generators[r]."),
    "priority": (
        "The key decides the order of both queues: the more urgent a request, the smaller its "
        "key, so admission takes it first and preemption takes it last. Preemption for a "
        "waiting request is a trade: it only pays if the running one is strictly less urgent, "
        "and only if room (seats or blocks) is what the waiting one lacks.",
        "priority_key is a tuple, compared element by element: the priority, then the arrival "
        "time (ties by arrival), then seq_id (same priority and arrival: created first). "
        "can_displace looks at self.running[-1], the least urgent running sequence: an equal "
        "priority must say no, or two equals would take turns preempting each other. Without "
        "chunked prefill a prompt runs whole, so if its tokens not found in the prefix cache "
        "exceed the budget, freeing blocks cannot help it.",
        "priority_key: return (seq.priority, seq.arrival_time, seq.seq_id).\n"
        "can_displace: if not self.running or self.running[-1].priority <= seq.priority: return "
        "False; if not self.enable_chunked_prefill: _, num_cached = "
        "self.block_manager.get_computed_blocks(seq); return seq.num_tokens - num_cached <= "
        "budget; return True."),
}
