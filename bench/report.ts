// Turns bench/results/latest.json into BENCHMARKS.md: every figure with its ratio to the raw limit
// and to each anchor, and each target checked.
import { writeFileSync } from 'node:fs';

type Row = Record<string, number | string | number[]>;
interface Results {
  date: string;
  machine: { cores: number; cpu?: string; node: string; redis: string };
  repeats: number;
  sequential?: Record<string, Row>;
  concurrent?: Record<string, Row>;
  contended?: Record<string, Record<string, Row>>;
  http?: Record<string, Row>;
  manyHeld?: Row;
}

const n = (v: unknown) => Number(v);
const x = (a: unknown, b: unknown) => `${(n(a) / n(b)).toFixed(2)}x`;
const fmt = (v: unknown) => (typeof v === 'number' ? v.toLocaleString('en-US') : String(v));
const check = (ok: boolean) => (ok ? 'met' : '**missed**');
const ANCHORS = ['redlock', 'sesame-redlock', 'redis-semaphore'];

export function writeReport(r: Results, file: string): void {
  const out: string[] = [];
  const targets: string[] = [];
  out.push('# Benchmarks', '');
  out.push(
    `Measured ${r.date.slice(0, 10)} with \`npm run bench\` on one private redis-server over loopback: ` +
      `${r.machine.cores} cores (${r.machine.cpu ?? 'unknown CPU'}), Node ${r.machine.node}, Redis ${r.machine.redis}. ` +
      `Each figure is the median of ${r.repeats} runs (scenarios 1 and 2 interleave the libraries, in a rotated order each round, so none is always the cold first one); ratios compare figures of the same run only. Raw results: ` +
      '[`bench/results/latest.json`](bench/results/latest.json).',
    '',
    'Anchors: `redlock` 5.0.0-beta.2, `@sesamecare-oss/redlock` (shown as sesame-redlock), `redis-semaphore` Mutex. ' +
      'The raw limit is ioredis `SET key id NX PX` plus a Lua compare-and-delete (waiting = spinning on SET NX with no delay).',
    '',
  );

  if (r.sequential) {
    const s = r.sequential;
    out.push('## 1. One client, acquire + release on fresh keys, sequential', '');
    out.push('| lock | pairs/s | p50 ms | p99 ms | vs raw | ' + ANCHORS.map((a) => `vs ${a}`).join(' | ') + ' |');
    out.push('|---|---|---|---|---|' + ANCHORS.map(() => '---').join('|') + '|');
    for (const [name, row] of Object.entries(s)) {
      if (name === 'ping') continue;
      out.push(`| ${name} | ${fmt(row.pairsPerSec)} | ${row.p50Ms} | ${row.p99Ms} | ${x(row.pairsPerSec, s.raw!.pairsPerSec)} | ` + ANCHORS.map((a) => x(row.pairsPerSec, s[a]!.pairsPerSec)).join(' | ') + ' |');
    }
    out.push('', `PING round trip in the same run: p50 ${s.ping!.p50Ms} ms, ${fmt(s.ping!.pingsPerSec)}/s.`, '');
    const ratio = n(s['nestjs-locked']!.pairsPerSec) / n(s.raw!.pairsPerSec);
    targets.push(`| 1 | pairs/s >= 0.95 x raw | ${ratio.toFixed(2)} x | ${check(ratio >= 0.95)} |`);
  }
  if (r.concurrent) {
    const s = r.concurrent;
    out.push('## 2. 64 concurrent workers on distinct keys', '');
    out.push('| lock | pairs/s | p99 ms | vs raw | ' + ANCHORS.map((a) => `vs ${a}`).join(' | ') + ' |');
    out.push('|---|---|---|---|' + ANCHORS.map(() => '---').join('|') + '|');
    for (const [name, row] of Object.entries(s)) {
      out.push(`| ${name} | ${fmt(row.pairsPerSec)} | ${row.p99Ms} | ${x(row.pairsPerSec, s.raw!.pairsPerSec)} | ` + ANCHORS.map((a) => x(row.pairsPerSec, s[a]!.pairsPerSec)).join(' | ') + ' |');
    }
    out.push('');
    const ratio = n(s['nestjs-locked']!.pairsPerSec) / n(s.raw!.pairsPerSec);
    targets.push(`| 2 | pairs/s >= 0.90 x raw | ${ratio.toFixed(2)} x | ${check(ratio >= 0.9)} |`);
  }
  if (r.contended) {
    out.push('## 3. 8 contenders on one key, holding ~1 ms', '');
    out.push(
      'Handoff: rounds in which each of the 8 workers takes the lock once (hold ~1 ms); every acquisition after the first of a round is a waiter getting the lock, ' +
        'timed from the moment the previous holder started its release, on a clock shared by the processes; acquisitions/s over those rounds. ' +
        'Fairness: a tight loop (acquire, hold ~1 ms, release, retry at once) for 2 s; Jain\'s index over the acquisitions of the 8 workers (1 = equal shares) and the share of acquisitions that went to another worker than the previous holder. ' +
        'Anchors with their default retry settings, and (-10ms) with the retry delay tuned to 10 ms.',
      '',
    );
    for (const [topology, rows] of Object.entries(r.contended)) {
      out.push(`### ${topology === '1x8' ? '1 process x 8 workers' : '2 processes x 4 workers'}`, '');
      out.push('| lock | acquisitions/s (rounds) | handoff p50 ms | handoff p99 ms | handoff p50 vs raw | tight loop acquisitions/s | fairness (Jain) | to another worker |');
      out.push('|---|---|---|---|---|---|---|---|');
      for (const [name, row] of Object.entries(rows)) {
        out.push(`| ${name} | ${fmt(row.acquisitionsPerSec)} | ${row.handoffP50Ms} | ${row.handoffP99Ms} | ${x(row.handoffP50Ms, rows.raw!.handoffP50Ms)} | ${fmt(row.loopAcquisitionsPerSec)} | ${row.fairness} | ${row.handoffsToAnotherWorker} |`);
      }
      out.push('');
      const ours = rows['nestjs-locked']!;
      const fair = rows['nestjs-locked-fair']!;
      const rtt = n(r.sequential?.ping?.p50Ms ?? NaN);
      targets.push(`| 3 (${topology}) | handoff p50 <= 2 x raw round trip (PING p50 ${rtt} ms) | ${ours.handoffP50Ms} ms = ${(n(ours.handoffP50Ms) / rtt).toFixed(1)} x | ${check(n(ours.handoffP50Ms) <= 2 * rtt)} |`);
      const semaphore = rows['redis-semaphore']!;
      targets.push(`| 3 (${topology}) | handoff p50 >= 10 x faster than redis-semaphore | ${(n(semaphore.handoffP50Ms) / n(ours.handoffP50Ms)).toFixed(1)} x | ${check(n(semaphore.handoffP50Ms) >= 10 * n(ours.handoffP50Ms))} |`);
      targets.push(`| 3 (${topology}) | fairness >= 0.9 in fair mode | ${fair.fairness} | ${check(n(fair.fairness) >= 0.9)} |`);
    }
  }
  if (r.http) {
    const h = r.http;
    out.push('## 4. An HTTP endpoint under load (autocannon, 16 connections, distinct keys)', '');
    out.push('| endpoint | requests/s | p99 ms | errors | vs no lock | vs hand-written lock |');
    out.push('|---|---|---|---|---|---|');
    for (const [name, row] of Object.entries(h)) {
      out.push(`| ${name === 'locked' ? '@Locked' : name === 'manual' ? 'hand-written SET NX / compare-and-delete' : 'no lock'} | ${fmt(row.requestsPerSec)} | ${row.p99Ms} | ${row.errors} | ${x(row.requestsPerSec, h.none!.requestsPerSec)} | ${x(row.requestsPerSec, h.manual!.requestsPerSec)} |`);
    }
    out.push('');
    const ratio = n(h.locked!.requestsPerSec) / n(h.manual!.requestsPerSec);
    targets.push(`| 4 | requests/s >= 0.90 x hand-written lock | ${ratio.toFixed(2)} x | ${check(ratio >= 0.9)} |`);
  }
  if (r.manyHeld) {
    const m = r.manyHeld;
    out.push(`## 5. ${fmt(m.locks)} locks held at once under the watchdog (lease 3 s, renewed every 1 s)`, '');
    out.push('| Redis calls per renewal period | event-loop delay p99 | heap per held lock | locks lost |');
    out.push('|---|---|---|---|');
    out.push(`| ${m.redisCallsPerRenewalPeriod} | ${m.eventLoopDelayP99Ms} ms | ${fmt(m.heapBytesPerLock)} B | ${m.lost} |`);
    out.push('');
    targets.push(`| 5 | <= ceil(N/100) = ${m.targetCallsPerPeriod} Redis calls per renewal period | ${m.redisCallsPerRenewalPeriod} | ${check(n(m.redisCallsPerRenewalPeriod) <= n(m.targetCallsPerPeriod))} |`);
    targets.push(`| 5 | event-loop delay p99 < 20 ms | ${m.eventLoopDelayP99Ms} ms | ${check(n(m.eventLoopDelayP99Ms) < 20)} |`);
    targets.push(`| 5 | <= 1 KiB heap per held lock | ${fmt(m.heapBytesPerLock)} B | ${check(n(m.heapBytesPerLock) <= 1024)} |`);
  }
  const missed = [
    '### Where targets are missed, and why',
    '',
    '- **Scenario 3, handoff <= 2 x PING.** As measured (from the moment the holder *starts* its release to the moment the next holder has its grant), a handoff spans the release round trip and then the waiter\'s acquire round trip, because the waiter can only try once the release has happened: 2 x PING is its floor with zero work in Node or Redis. The raw lock, whose 7 waiters spin on SET NX with no delay, itself measures about 4 x PING. Ours, woken by the release message instead of spinning, is compared with raw in the table (handoff p50 vs raw); the >= 10 x faster than redis-semaphore target is met. Not fixed: the target needs a new definition (for example, from the release taking effect in Redis to the next grant) rather than a faster lock.',
    '- **Scenarios 1, 2 and 4, throughput against raw SET NX.** Our acquire script does more than SET NX: a hash with a hold count (reentrancy) and an INCR of a fencing counter with its expiry, on every fresh grant; Redis runs it on the same 2 cores as the benchmark. Ratios also move with the machine: on 2026-11-23 five back-to-back `BENCH_ONLY=1` runs gave nestjs-locked 0.67 to 0.81 x raw in scenario 1 (the code of 2026-11-22 measured 0.67 x in the same series), against 0.93 x on 2026-11-22, so one run\'s ratio is not a verdict. Not profiled yet; candidates are the fencing counter (a second key per grant) and, in scenario 4, the interceptor\'s per-request work (AsyncLocalStorage context, key template, events).',
    '',
  ];
  out.splice(6, 0, '## Targets', '', '| scenario | target | this run | |', '|---|---|---|---|', ...targets, '', ...missed);
  writeFileSync(file, out.join('\n') + '\n');
}
