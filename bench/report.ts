// Turns bench/results/latest.json into BENCHMARKS.md: every figure with its ratio to the raw limit
// and to each anchor, and each target checked.
import { existsSync, readFileSync, writeFileSync } from 'node:fs';
import { dirname, join } from 'node:path';
import { median, type Machine } from './stats.js';

type Row = Record<string, number | string | number[]>;
interface Results {
  date: string;
  machine: Machine;
  repeats: number;
  /** Rounds of scenarios 1, 2 and 4 (absent in runs before they were sliced). */
  slices?: number;
  sequential?: Record<string, Row>;
  concurrent?: Record<string, Row>;
  contended?: Record<string, Record<string, Row>>;
  /** Scenario 3's PING round trips at its own concurrency, per topology (absent in runs before 2026-11-24's last). */
  contendedPing?: Record<string, Row>;
  /** Scenario 3's PING round trips with one caller, taken in each of its rounds, per topology (absent before its rounds). */
  contendedPingOneCaller?: Record<string, Row>;
  /**
   * Scenario 3's rounds, each running every kind and both PING readings once (absent in runs before
   * 2026-11-24's rounds, whose kinds each ran all their runs back to back).
   */
  contendedRounds?: number;
  http?: Record<string, Row>;
  manyHeld?: Row;
}

const n = (v: unknown) => Number(v);
const x = (a: unknown, b: unknown) => `${(n(a) / n(b)).toFixed(2)}x`;
const fmt = (v: unknown) => (typeof v === 'number' ? v.toLocaleString('en-US') : String(v));
const check = (ok: boolean) => (ok ? 'met' : '**missed**');
/**
 * `a`'s `field` relative to `b`'s. Rows of scenarios 1, 2 and 4 carry one rate per round in `runs`,
 * in round order, and are compared round by round (the median of the per-round ratios): both rates of
 * a round were measured within a second or two of each other, so a change in the machine's speed
 * between rounds cancels out. Rows without such rounds: the ratio of the two figures.
 */
const rel = (a: Row, b: Row, field: string) => {
  const ratios = roundRatios(a.runs as number[] | undefined, b.runs as number[] | undefined);
  return ratios ? median(ratios) : n(a[field]) / n(b[field]);
};
const xr = (ratio: number) => `${ratio.toFixed(2)}x`;
/**
 * Scenario 3: `a`'s handoff (or PING) p50 relative to `b`'s. In runs with rounds, `runs` holds that
 * p50 of every round in round order: the median of the per-round ratios, as `rel`. Before: the ratio of
 * the two medians (their runs were minutes apart, so pairing them would mean nothing).
 */
const p50Ratio = (r: Results, a: Row, b: Row) => {
  const ratios = r.contendedRounds ? roundRatios(a.runs as number[] | undefined, b.runs as number[] | undefined) : undefined;
  return ratios ? median(ratios) : p50Of(a) / p50Of(b);
};
/** A scenario-3 row's p50: a handoff's, or a PING reading's. */
const p50Of = (row: Row) => n(row.handoffP50Ms ?? row.p50Ms);
/** Whether scenario 3's rows of one topology have the releases' own round trips (recorded since 2026-11-25). */
const recordsReleases = (rows: Record<string, Row>) => rows.raw?.releaseP50Ms !== undefined;
/**
 * What scenario 3's handoffs in `topology` are checked against, the rows present in this run: the raw
 * limit's handoff, PING with one caller (taken in the rounds, or in runs before them once in
 * scenario 1) and PING at the same concurrency. `name` for the explanation, `target` for the
 * targets table.
 */
function yardsticks(r: Results, topology: string, rows: Record<string, Row>): { name: string; target: string; row: Row }[] {
  const all = [
    { name: "the raw limit's handoff", target: "the raw limit's release-to-acquire handoff", row: rows.raw },
    { name: 'PING with one caller', target: 'PING round trip, one caller', row: r.contendedPingOneCaller?.[topology] ?? r.sequential?.ping },
    { name: 'PING at the same concurrency', target: 'PING round trip at the same concurrency', row: r.contendedPing?.[topology] },
  ];
  return all.filter((y): y is { name: string; target: string; row: Row } => y.row !== undefined);
}
const ANCHORS = ['redlock', 'sesame-redlock', 'redis-semaphore'];
const HTTP_LABELS: Record<string, string> = {
  none: 'no lock',
  locked: '@Locked',
  manual: 'hand-written SET NX / compare-and-delete',
  service: 'LockService.run() in the handler (no decorator)',
  interceptor: 'LockInterceptor only (no lock)',
};

export function writeReport(r: Results, file: string): void {
  const out: string[] = [];
  const targets: string[] = [];
  out.push('# Benchmarks', '');
  out.push(
    `Measured ${r.date.slice(0, 10)} with \`npm run bench\` on one private redis-server over loopback: ` +
      `${describeMachine(r.machine)}. ` +
      (r.slices
        ? `Scenarios 1, 2 and 4 run in ${r.slices} rounds of short slices (500 sequential pairs; 64 workers x 40 pairs; 2 s of autocannon), every library or endpoint once per round in a rotated order, on clients opened once: each figure is the median of its ${r.slices} slices, and each ratio the median of the ${r.slices} per-round ratios, so that the two sides of a ratio always ran within a second or two of each other (the speed of this machine moves by up to 2 x from one second to the next${spanOf(r.sequential?.raw)}). ${r.contendedRounds ? `Scenario 3 runs in ${r.contendedRounds} rounds per topology in the same way (its section says how), scenario 5 is the median of ${r.repeats} runs` : `Scenarios 3 and 5: the median of ${r.repeats} runs`}. `
        : `Each figure is the median of ${r.repeats} runs (scenarios 1 and 2 interleave the libraries and scenario 4 the endpoints, in a rotated order each round, so none is always the cold first one). `) +
      'Ratios compare figures of the same run only. Raw results: ' +
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
      out.push(`| ${name} | ${fmt(row.pairsPerSec)} | ${row.p50Ms} | ${row.p99Ms} | ${xr(rel(row, s.raw!, 'pairsPerSec'))} | ` + ANCHORS.map((a) => xr(rel(row, s[a]!, 'pairsPerSec'))).join(' | ') + ' |');
    }
    out.push('', `PING round trip in the same run: p50 ${s.ping!.p50Ms} ms, ${fmt(s.ping!.pingsPerSec)}/s.`, '');
    if (s.scripts) out.push('`scripts` is nestjs-locked\'s own acquire and release scripts sent from a bare ioredis client, with the keys and arguments the library gives them: a raw lock that keeps the same promises (hold count, fencing token, wake-up for waiters), without LockService.', '');
    const ratio = rel(s['nestjs-locked']!, s.raw!, 'pairsPerSec');
    targets.push(`| 1 | pairs/s >= 0.95 x raw | ${ratio.toFixed(2)} x | ${check(ratio >= 0.95)} |`);
    if (s.scripts) targets.push(`| 1 (reference, not a target) | pairs/s against nestjs-locked's own scripts from a bare client (\`scripts\`) | ${rel(s['nestjs-locked']!, s.scripts, 'pairsPerSec').toFixed(2)} x | - |`);
    if (s['nestjs-locked-no-fencing']) targets.push(`| 1 (reference, not a target) | pairs/s against raw with \`fencingTokens: false\` | ${rel(s['nestjs-locked-no-fencing'], s.raw!, 'pairsPerSec').toFixed(2)} x | - |`);
  }
  if (r.concurrent) {
    const s = r.concurrent;
    out.push('## 2. 64 concurrent workers on distinct keys', '');
    out.push('| lock | pairs/s | p99 ms | vs raw | ' + ANCHORS.map((a) => `vs ${a}`).join(' | ') + ' |');
    out.push('|---|---|---|---|' + ANCHORS.map(() => '---').join('|') + '|');
    for (const [name, row] of Object.entries(s)) {
      out.push(`| ${name} | ${fmt(row.pairsPerSec)} | ${row.p99Ms} | ${xr(rel(row, s.raw!, 'pairsPerSec'))} | ` + ANCHORS.map((a) => xr(rel(row, s[a]!, 'pairsPerSec'))).join(' | ') + ' |');
    }
    out.push('');
    if (s['raw-batched']) {
      out.push(
        'nestjs-locked writes the commands its callers send in one pass of the event loop together, one socket write per 8 (README, "Write batching"), where ioredis alone writes each command on its own: with 64 callers, Redis then reads and Node writes once per 8 commands instead of once per command. ' +
          `\`raw-batched\` is the raw limit sending its commands the same way: it tells that batching apart from the rest of the lock's cost. nestjs-locked reaches ${xr(rel(s['nestjs-locked']!, s['raw-batched'], 'pairsPerSec'))} of it, and the batching alone takes the raw limit to ${xr(rel(s['raw-batched'], s.raw!, 'pairsPerSec'))}. ` +
          'One caller at a time (scenario 1) has nothing to batch: a command sent while its connection has nothing in flight is written at once. ' +
          'What batching buys moves with the machine: how it read in the full runs before this one, and in paired runs of two libraries that tell the library\'s speed apart from the machine\'s: "Earlier runs" below (scenario 2, by run).',
        '',
      );
    }
    const ratio = rel(s['nestjs-locked']!, s.raw!, 'pairsPerSec');
    targets.push(`| 2 | pairs/s >= 0.90 x raw | ${ratio.toFixed(2)} x | ${check(ratio >= 0.9)} |`);
    if (s['raw-batched']) targets.push(`| 2 (reference, not a target) | pairs/s against the raw limit with the same write batching | ${rel(s['nestjs-locked']!, s['raw-batched'], 'pairsPerSec').toFixed(2)} x | - |`);
  }
  if (r.contended) {
    out.push('## 3. 8 contenders on one key, holding ~1 ms', '');
    out.push(
      'Handoff: rounds in which each of the 8 workers takes the lock once (hold ~1 ms); every acquisition after the first of a round is a waiter getting the lock, ' +
        'timed from the moment the previous holder started its release, on a clock shared by the processes; acquisitions/s over those rounds. ' +
        'Fairness: a tight loop (acquire, hold ~1 ms, release, retry at once) for 2 s; Jain\'s index over the acquisitions of the 8 workers (1 = equal shares) and the share of acquisitions that went to another worker than the previous holder. ' +
        'Anchors with their default retry settings, and (-10ms) with the retry delay tuned to 10 ms. ' +
        (Object.values(r.contended).some(recordsReleases) ? 'Release: how long the holder\'s release took, from its start to its reply (in the median round). ' : '') +
        (r.contendedRounds
          ? `The scenario runs in ${r.contendedRounds} rounds per topology, each running every library and both PING readings once, in a rotated order: each row is a library's median round by handoff p50, and each ratio (here and in the targets) the median of the ${r.contendedRounds} per-round ratios, so the two sides of a ratio ran within seconds of each other.`
          : `Each row is the median of ${r.repeats} runs, one library's runs back to back; ratios are of the medians.`),
      '',
    );
    for (const [topology, rows] of Object.entries(r.contended)) {
      out.push(`### ${topology === '1x8' ? '1 process x 8 workers' : '2 processes x 4 workers'}`, '');
      const releases = recordsReleases(rows);
      out.push(`| lock | acquisitions/s (rounds) | handoff p50 ms | handoff p99 ms | ${releases ? 'release p50 ms | ' : ''}handoff p50 vs raw | tight loop acquisitions/s | fairness (Jain) | to another worker |`);
      out.push(`|---|---|---|---|${releases ? '---|' : ''}---|---|---|---|`);
      for (const [name, row] of Object.entries(rows)) {
        out.push(`| ${name} | ${fmt(row.acquisitionsPerSec)} | ${row.handoffP50Ms} | ${row.handoffP99Ms} | ${releases ? `${row.releaseP50Ms ?? ''} | ` : ''}${xr(p50Ratio(r, row, rows.raw!))} | ${fmt(row.loopAcquisitionsPerSec)} | ${row.fairness} | ${row.handoffsToAnotherWorker} |`);
      }
      out.push('');
      const ping = r.contendedPing?.[topology];
      const one = r.contendedPingOneCaller?.[topology];
      if (ping) {
        out.push(
          `PING round trips in the same ${r.contendedRounds ? 'rounds' : 'run'}: at the same concurrency (${topology === '1x8' ? '8 callers on one client' : '2 processes x 4 callers, one client each'}, all at once) p50 ${ping.p50Ms} ms, p99 ${ping.p99Ms} ms, ${fmt(ping.pingsPerSec)}/s` +
            (one ? `; one caller p50 ${one.p50Ms} ms, p99 ${one.p99Ms} ms, ${fmt(one.pingsPerSec)}/s` : '') +
            '.',
          '',
        );
      }
      const fair = rows['nestjs-locked-fair']!;
      const semaphore = rows['redis-semaphore']!;
      for (const [mode, row] of [['fair mode', fair], ['default mode', rows['nestjs-locked']!]] as const) {
        for (const { target, row: base } of yardsticks(r, topology, rows)) {
          const ratio = p50Ratio(r, row, base);
          const rawNote = base === rows.raw ? '' : `; the raw limit: ${p50Ratio(r, rows.raw!, base).toFixed(1)} x`;
          targets.push(`| 3 (${topology}) | ${mode}: handoff p50 <= 2 x ${target} (p50 ${p50Of(base)} ms${rawNote}) | ${row.handoffP50Ms} ms${r.contendedRounds ? ', median round' : ' ='} ${ratio.toFixed(2)} x | ${check(ratio <= 2)} |`);
        }
        const faster = p50Ratio(r, semaphore, row);
        targets.push(`| 3 (${topology}) | ${mode}: handoff p50 >= 10 x faster than redis-semaphore | ${faster.toFixed(1)} x | ${check(faster >= 10)} |`);
      }
      targets.push(`| 3 (${topology}) | fairness >= 0.9 in fair mode | ${fair.fairness} | ${check(n(fair.fairness) >= 0.9)} |`);
    }
  }
  if (r.http) {
    const h = r.http;
    out.push('## 4. An HTTP endpoint under load (autocannon, 16 connections, distinct keys)', '');
    out.push('| endpoint | requests/s | p99 ms | errors | vs no lock | vs hand-written lock |');
    out.push('|---|---|---|---|---|---|');
    for (const [name, row] of Object.entries(h)) {
      out.push(`| ${HTTP_LABELS[name] ?? name} | ${fmt(row.requestsPerSec)} | ${row.p99Ms} | ${row.errors} | ${xr(rel(row, h.none!, 'requestsPerSec'))} | ${xr(rel(row, h.manual!, 'requestsPerSec'))} |`);
    }
    out.push('');
    if (h.service && h.interceptor) {
      const us = (rps: unknown) => 1e6 / n(rps);
      out.push(
        `Per request, in microseconds of the app's time (from the medians above): the hand-written lock adds ${(us(h.manual!.requestsPerSec) - us(h.none!.requestsPerSec)).toFixed(0)}, ` +
          `LockService.run() ${(us(h.service.requestsPerSec) - us(h.none!.requestsPerSec)).toFixed(0)}, @Locked ${(us(h.locked!.requestsPerSec) - us(h.none!.requestsPerSec)).toFixed(0)}, ` +
          `and LockInterceptor alone (no lock; @Locked no longer goes through it on HTTP routes) ${(us(h.interceptor.requestsPerSec) - us(h.none!.requestsPerSec)).toFixed(0)}.`,
        '',
      );
    }
    const ratio = rel(h.locked!, h.manual!, 'requestsPerSec');
    targets.push(`| 4 | requests/s >= 0.90 x hand-written lock | ${ratio.toFixed(2)} x | ${check(ratio >= 0.9)} |`);
  }
  if (r.manyHeld) {
    const m = r.manyHeld;
    out.push(`## 5. ${fmt(m.locks)} locks held at once under the watchdog (lease 3 s, renewed every 1 s)`, '');
    out.push('| Redis calls per renewal period | event-loop delay p99 | heap per held lock | locks lost |');
    out.push('|---|---|---|---|');
    out.push(`| ${m.redisCallsPerRenewalPeriod} | ${m.eventLoopDelayP99Ms} ms | ${fmt(m.heapBytesPerLock)} B | ${m.lost} |`);
    out.push('');
    if (m.redisBytesPerHeldLock !== undefined) {
      out.push(
        `Redis memory (used_memory, in a database of its own): ${fmt(m.redisBytesPerHeldLock)} B per held lock (its hash and fencing counter, with their expiry entries), ` +
          `and ${fmt(m.redisBytesPerReleasedKey)} B per key after the release: the fencing counter, kept for an hour after the key's last grant, so an app that locks many distinct keys keeps about that much per key locked in the last hour.`,
        '',
      );
    }
    if (m.redisUsPerRenewedLock !== undefined) {
      out.push(`Redis's time in the renewal scripts (INFO commandstats): ${m.redisUsPerRenewedLock} us per lock renewed.`, '');
    }
    targets.push(`| 5 | <= ceil(N/100) = ${m.targetCallsPerPeriod} Redis calls per renewal period | ${m.redisCallsPerRenewalPeriod} | ${check(n(m.redisCallsPerRenewalPeriod) <= n(m.targetCallsPerPeriod))} |`);
    targets.push(`| 5 | event-loop delay p99 < 20 ms | ${m.eventLoopDelayP99Ms} ms | ${check(n(m.eventLoopDelayP99Ms) < 20)} |`);
    targets.push(`| 5 | <= 1 KiB heap per held lock | ${fmt(m.heapBytesPerLock)} B | ${check(n(m.heapBytesPerLock) <= 1024)} |`);
  }
  const extra = readExtras(dirname(file));
  const missed = ['### Where targets are missed, and why', '', ...explainMisses(r, extra), ''];
  out.splice(6, 0, '## Targets', '', '| scenario | target | this run | |', '|---|---|---|---|', ...targets, '', ...missed);
  out.push(...profileSection(r, extra));
  // Hand-written notes on earlier runs (bench/earlier-runs.md), kept under the figures of this one.
  const earlier = join(dirname(file), 'bench', 'earlier-runs.md');
  if (existsSync(earlier)) out.push('', readFileSync(earlier, 'utf8').trimEnd());
  writeFileSync(file, out.join('\n') + '\n');
}

interface Cost {
  pairsPerSec: number;
  nodeCpuUsPerPair: number;
  redisCpuUsPerPair: number;
  redisCommandsPerPair: number;
  vsRaw?: number;
}
interface Extras {
  /** `npm run bench:profile` on the current code (bench/results/profile.json). */
  profile?: Record<string, Record<string, Cost>>;
  /** The same on the code before the profiling work (bench/results/profile-before.json). */
  profileBefore?: Record<string, Record<string, Cost>>;
  /** Scenario 4 of `npm run bench:profile`: CPU per request of the app and of Redis (bench/results/profile-http.json). */
  profileHttp?: Record<string, { requestsPerSec: number; appCpuUsPerRequest: number; redisCpuUsPerRequest: number; appCpuVsManual?: number; redisCpuVsManual?: number }>;
  /** `PROFILE_ALLOC=1 npm run bench:profile`: bytes Node allocates per sequential pair (bench/results/profile-alloc.json). */
  alloc?: Record<string, number>;
  /** Scenario 1 of `npm run bench:profile` with the script variants (bench/results/profile-breakdown.json). */
  breakdown?: Record<string, Record<string, Cost>>;
  /**
   * Runs of scenario 1 alone with the `scripts` row (`BENCH_ONLY=1 npm run bench`, collected by hand in
   * bench/results/scenario1-runs.json): nestjs-locked against its own scripts in the target's harness.
   */
  scenario1Runs?: { date: string; sequential: Record<string, Row> }[];
  /** How the breakdown was run (written since 2026-11-25; before: 15 rounds of 4,000 pairs). */
  breakdownSettings: { rounds: number; sequentialPairs: number };
  /** `npm run bench:instructions` (bench/results/redis-instructions.json). */
  instructions?: { pairs: number; instructionsPerPair: Record<string, number> };
  /** When and where each profile file was measured (written by `npm run bench:profile` since 2026-12-07). */
  measured: { breakdown?: Measured; profileHttp?: Measured; alloc?: Measured };
}

/** What `npm run bench:profile` writes under `measured` in each results file. */
interface Measured {
  date: string;
  machine: Machine;
  command?: string;
}

const describeMachine = (m: Machine) => `${m.cores} cores (${m.cpu ?? 'unknown CPU'}), Node ${m.node}, Redis ${m.redis}`;

/**
 * When and where a profile file was measured, against the full run of this report: ", on <day>, on
 * a machine with the full run's cores, CPU, Node and Redis" (", after it" or ", before it" when the
 * file has the time and the day is the run's) when all four match the run's, the machine itself
 * otherwise; empty for files written before profiles recorded it.
 */
function measuredWhere(m: Measured | undefined, r: Results): string {
  if (!m) return '';
  const same = describeMachine(m.machine) === describeMachine(r.machine);
  // A date without a time (files that had it added by hand) cannot be placed before or after the run.
  const relative = m.date.length > 10 && m.date.slice(0, 10) === r.date.slice(0, 10) ? (m.date > r.date ? ', after it' : ', before it') : '';
  return `, on ${m.date.slice(0, 10)}, on ${same ? `a machine with the full run's cores, CPU, Node and Redis${relative}` : describeMachine(m.machine)}`;
}

function readExtras(root: string): Extras {
  const read = (name: string) => {
    const path = join(root, 'bench', 'results', name);
    return existsSync(path) ? JSON.parse(readFileSync(path, 'utf8')) : undefined;
  };
  // `npm run bench:profile` writes its settings next to the scenarios (since 2026-11-25), and when
  // and where it measured (since 2026-12-07).
  const scenarios = (name: string) => {
    const json = read(name) as ({ settings?: Extras['breakdownSettings']; measured?: Measured } & Record<string, Record<string, Cost>>) | undefined;
    if (!json) return { data: undefined, settings: undefined, measured: undefined };
    const { settings, measured, ...data } = json;
    return { data: data as Record<string, Record<string, Cost>>, settings, measured };
  };
  const withMeasured = <T>(name: string) => {
    const { measured, ...data } = (read(name) ?? {}) as { measured?: Measured } & Record<string, T>;
    return { data: Object.keys(data).length ? data : undefined, measured };
  };
  const breakdown = scenarios('profile-breakdown.json');
  const http = withMeasured<NonNullable<Extras['profileHttp']>[string]>('profile-http.json');
  const alloc = withMeasured<number>('profile-alloc.json');
  return {
    profile: scenarios('profile.json').data,
    profileBefore: scenarios('profile-before.json').data,
    profileHttp: http.data,
    instructions: read('redis-instructions.json'),
    alloc: alloc.data,
    breakdown: breakdown.data,
    scenario1Runs: read('scenario1-runs.json'),
    breakdownSettings: breakdown.settings ?? { rounds: 15, sequentialPairs: 4_000 },
    measured: { breakdown: breakdown.measured, profileHttp: http.measured, alloc: alloc.measured },
  };
}


/**
 * Scenario 1 missed: what meeting it would take, from the breakdown's rounds (each variant's median
 * ratio to the raw limit), so the choice the target leaves open is stated with its figures.
 */
function whatScenario1Needs(r: Results, e: Extras): string | undefined {
  const b = e.breakdown?.['1 sequential'];
  const ratio = (kind: string) => b?.[kind]?.vsRaw;
  const [all, noFence, floor, ours, oursNoFence] = ['scripts', 'scripts-no-fencing', 'scripts-hold-count-only', 'nestjs-locked', 'nestjs-locked-no-fencing'].map(ratio);
  if (all === undefined || noFence === undefined || floor === undefined || ours === undefined || oursNoFence === undefined) return undefined;
  if (ours >= 0.95 || oursNoFence >= 0.95) return undefined;
  // LockService keeping the hold count only (bench/profile.ts): measured in breakdowns since 2026-11-25.
  const lean = ratio('nestjs-locked-hold-count-only');
  const empty = ratio('scripts-empty');
  const bare =
    floor >= 0.95
      ? `Of the bare scripts, only a hash with a hold count and nothing else (no fencing token, no wake-up for waiters) reaches it, at ${xr(floor)}${empty !== undefined && empty >= 0.95 ? ' (besides two scripts with empty bodies, which lock nothing)' : ''}`
      : `${empty !== undefined && empty >= 0.95 ? 'Of the bare scripts, only two with empty bodies (which lock nothing) reach it; the closest that locks' : 'None of the bare scripts reaches it; the closest'}, a hash with a hold count and nothing else (no fencing token, no wake-up for waiters), reads ${xr(floor)}`;
  const costs = [`${xr(all)} to ${xr(ours)} with every part`, `${xr(noFence)} to ${xr(oursNoFence)} without the token`];
  let withoutBoth: string;
  if (lean !== undefined) {
    costs.push(`${xr(floor)} to ${xr(lean)} with the hold count only`);
    withoutBoth =
      `LockService keeping the hold count only (\`PROFILE_KINDS=nestjs-locked-hold-count-only\`: \`fencingTokens: false\` and a release that wakes nobody, which the library never runs) measured ${xr(lean)}: ` +
      (lean >= 0.95 ? 'dropping both promises would meet the target.' : 'dropping both promises would not meet the target either.');
  } else {
    const service = Math.max(all - ours, noFence - oursNoFence);
    if (floor - service >= 0.95) return undefined;
    withoutBoth = `So a LockService that kept neither promise would be expected near ${xr(floor - service)} (not built, not measured).`;
  }
  const same = ours / all;
  // The same reading in the target's own harness (36 rounds of 500-pair slices, lockers kept open): this
  // run's `scripts` row, and the runs of scenario 1 alone collected in scenario1-runs.json.
  const harness = [r.sequential, ...(e.scenario1Runs ?? []).map((run) => run.sequential)]
    .filter((seq): seq is Record<string, Row> => seq?.scripts !== undefined && seq['nestjs-locked'] !== undefined)
    .map((seq) => rel(seq['nestjs-locked']!, seq.scripts!, 'pairsPerSec'));
  const verdict = harness.length > 0 ? median(harness) : same;
  const sources = [
    r.sequential?.scripts ? 'this run' : undefined,
    e.scenario1Runs?.length ? `${e.scenario1Runs.length} runs of scenario 1 alone, \`BENCH_REPEATS=9 BENCH_ONLY=1 npm run bench\`, kept in bench/results/scenario1-runs.json` : undefined,
  ].filter((source) => source !== undefined);
  const inHarness =
    harness.length > 0
      ? ` In scenario 1's own harness (the \`scripts\` row of ${sources.join(' and of ')}), it reads ${harness.map((h) => h.toFixed(2)).join(', ')} x its own scripts (each the median of a run's per-round ratios).`
      : '';
  const opening =
    verdict >= 0.95 || (lean !== undefined && lean >= 0.95)
      ? 'This is a choice about what the lock promises, left to the maintainers; no default was changed for it.'
      : 'In these measurements no choice of what the lock promises meets it (below); no default was changed.';
  return (
    `- **Scenario 1: what meeting the target would take.** ${opening} ` +
    `\n  - **Through LockService.** In the breakdown's rounds (profile-breakdown.json), neither setting measured through LockService reaches 0.95 x: the defaults ${xr(ours)}, \`fencingTokens: false\` ${xr(oursNoFence)}. ` +
    `\n  - **Dropping promises.** ${bare}. LockService's own work takes each set of scripts lower (${costs.join(', ')}). ${withoutBoth} ` +
    `\n  - **Against its own scripts.** Sent from a bare client (a raw lock that keeps the same promises), nestjs-locked reaches ${xr(same)} in these rounds (the ratio of the two medians; like every reading here, it moves with the machine).${inHarness} ` +
    (verdict >= 0.95
      ? `The one reading under which it is met is against such a lock instead of SET NX, which keeps no hold count, issues no token and wakes nobody; until that is decided, the target stays missed.`
      : `Under that reading it is missed too${harness.length > 0 ? '' : ' in these rounds'}: there the gap is LockService's own work, which keeps no promise of its own and is what is left to make cheaper; the target stays missed.`)
  );
}

function explainMisses(r: Results, e: Extras): string[] {
  const lines: string[] = [];
  const missed1 = r.sequential && rel(r.sequential['nestjs-locked']!, r.sequential.raw!, 'pairsPerSec') < 0.95;
  const missed2 = r.concurrent && rel(r.concurrent['nestjs-locked']!, r.concurrent.raw!, 'pairsPerSec') < 0.9;
  if (missed1 || missed2) {
    const i = e.instructions?.instructionsPerPair;
    const p = e.profile;
    const seq = p?.['1 sequential'];
    const par = p?.['2 64 workers'];
    let text =
      `- **${missed1 && missed2 ? 'Scenarios 1 and 2' : missed1 ? 'Scenario 1' : 'Scenario 2'}, pairs/s against raw SET NX.** Our two scripts do more than SET NX and a compare-and-delete: a hash with a hold count (reentrancy), a fencing token (Redis TIME and a SET ... GET on a counter key) on every fresh grant, and a release announcement for waiters (one EXISTS of the lock and its fair queue, PUBLISH).`;
    if (i) {
      const ours = i['nestjs-locked scripts']!;
      const empty = i['breakdown: empty scripts'];
      const noFence = i['breakdown: acquire without fencing token'];
      const noAnnounce = i['breakdown: release without announcement'];
      text += `\n  - **What Redis does per pair.** Counted by callgrind (below), one pair costs redis-server ${(ours / i.raw!).toFixed(2)} x the raw pair's instructions`;
      if (empty && noFence && noAnnounce) {
        text += `: of our ${fmt(ours)}, two EVALSHA calls with empty bodies already cost ${fmt(empty)} (the whole raw pair: ${fmt(i.raw!)}), the fencing token ${fmt(ours - noFence)}, the announcement ${fmt(ours - noAnnounce)}`;
        const floor = i['breakdown: hold count only (neither token nor announcement)'];
        if (floor) text += `; a hash with a hold count and neither of them still costs ${fmt(floor)} (${(floor / i.raw!).toFixed(2)} x raw)`;
        const off = i['nestjs-locked scripts, fencingTokens: false'];
        if (off) text += `; with \`fencingTokens: false\` our scripts cost ${fmt(off)}`;
      }
      text += '.';
    }
    const b = e.breakdown?.['1 sequential'];
    const { rounds, sequentialPairs } = e.breakdownSettings;
    if (missed1 && b?.scripts?.vsRaw !== undefined && b['scripts-no-fencing']?.vsRaw !== undefined && b['scripts-no-announcement']?.vsRaw !== undefined && b['scripts-empty']?.vsRaw !== undefined) {
      text +=
        `\n  - **What it costs in time.** One caller at a time (\`PROFILE_SCENARIOS=1 PROFILE_ROUNDS=${rounds}${sequentialPairs === 4_000 ? '' : ` PROFILE_PAIRS=${sequentialPairs}`} PROFILE_KINDS=${Object.keys(b).join(',')} npm run bench:profile\`, bench/results/profile-breakdown.json, each figure the median of ${rounds} per-round ratios to the raw limit, each round ${fmt(sequentialPairs)} pairs of each kind${measuredWhere(e.measured.breakdown, r)}): ` +
        `the bare scripts reach ${xr(b.scripts.vsRaw)}, ${xr(b['scripts-no-fencing'].vsRaw)} without the fencing token, ${xr(b['scripts-no-announcement'].vsRaw)} without the announcement, and two scripts with empty bodies ${xr(b['scripts-empty'].vsRaw)}` +
        (b['nestjs-locked']?.vsRaw !== undefined ? `; nestjs-locked itself ${xr(b['nestjs-locked'].vsRaw)}` : '') +
        '.' +
        (b['scripts-empty'].vsRaw >= 0.95 && b['scripts-no-fencing'].vsRaw > b['scripts-no-announcement'].vsRaw
          ? ' Running two scripts instead of SET and one script costs little in time; what our scripts do in them costs the rest, the fencing token most.'
          : '') +
        (b['scripts-no-fencing'].vsRaw < 0.95 && b['scripts-no-announcement'].vsRaw < 0.95 ? ' Taking out either part alone does not reach 0.95 x.' : '') +
        (b['scripts-hold-count-only']?.vsRaw !== undefined ? ` Taking out both (a hash with a hold count only) reaches ${xr(b['scripts-hold-count-only'].vsRaw)}.` : '') +
        (b['nestjs-locked-no-fencing']?.vsRaw !== undefined ? ` nestjs-locked with \`fencingTokens: false\` reached ${xr(b['nestjs-locked-no-fencing'].vsRaw)}.` : '');
    }
    // The bare scripts against LockService: from the breakdown when it has both (measured in the same
    // rounds as the ratios above, so the sentences agree), else from profile.json.
    const bare = b?.scripts?.vsRaw !== undefined && b['nestjs-locked']?.vsRaw !== undefined ? b : undefined;
    if (bare || (seq?.scripts && par?.scripts)) {
      const ceiling = bare
        ? `${xr(bare.scripts!.vsRaw!)} raw in scenario 1 (profile-breakdown.json)`
        : `${x(seq!.scripts!.pairsPerSec, seq!.raw!.pairsPerSec)} raw in scenario 1${missed2 ? ` and ${x(par!.scripts!.pairsPerSec, par!.raw!.pairsPerSec)} in scenario 2` : ''}`;
      const service = bare
        ? `LockService's own work (options, the held-lock record, the handle, the watchdog's bookkeeping; about a third of it is its store's: the count of steps in flight, the script wrapper, "Earlier runs" below, the store's share) takes that to ${xr(bare['nestjs-locked']!.vsRaw!)}: ${bare['nestjs-locked']!.nodeCpuUsPerPair} against ${bare.scripts!.nodeCpuUsPerPair} us of Node CPU per pair in the same rounds (process.cpuUsage, kernel time included). `
        : `LockService adds ${(seq!['nestjs-locked']!.nodeCpuUsPerPair - seq!.scripts!.nodeCpuUsPerPair).toFixed(1)} us (scenario 1)${missed2 ? ` and ${(par!['nestjs-locked']!.nodeCpuUsPerPair - par!.scripts!.nodeCpuUsPerPair).toFixed(1)} us (scenario 2)` : ''} of Node CPU per pair on top. `;
      text +=
        `\n  - **Without LockService.** Sent from a bare ioredis client with no LockService (the \`scripts\` row of \`npm run bench:profile\`), these scripts reach ${ceiling} in that run: the ceiling for this data model on this machine${missed2 ? '' : ' while one caller at a time leaves no commands to batch (unlike scenario 2)'}. ` +
        service +
        (e.alloc?.raw && e.alloc.scripts && e.alloc['nestjs-locked']
          ? `It allocates ${fmt(e.alloc['nestjs-locked'])} bytes per pair in Node, against ${fmt(e.alloc.scripts)} for the bare scripts and ${fmt(e.alloc.raw)} for the raw limit (\`PROFILE_ALLOC=1 npm run bench:profile\`${measuredWhere(e.measured.alloc, r)}: the handle, the held-lock record, the owner's context and the promises of each step). `
          : '') +
        (missed2 ? 'In scenario 2 Redis and Node share the 2 cores, so pairs/s follows the sum of both processes\' CPU per pair.' : '');
    }
    const anchorRatios = r.sequential ? ANCHORS.filter((a) => r.sequential![a]).map((a) => `${a} ${xr(rel(r.sequential![a]!, r.sequential!.raw!, 'pairsPerSec'))}`) : [];
    text =
      text.trimEnd() +
      '\n  - **What we chose.** The hold count, the fencing token and the wake-up announcement stay on by default, as they are what the lock promises (issues 1 and 4); `fencingTokens: false` takes the token off for apps whose resources do not check it (the reference row under the targets).' +
      (missed1 && anchorRatios.length ? `\n  - **The anchors**, which keep no hold count and issue no tokens, read ${anchorRatios.join(', ')} of the raw limit in this run.` : '') +
      '\n  - **Noise.** Ratios also move with the machine: before these scenarios ran in short slices (2026-11-24), back-to-back runs of the same code gave 0.67 to 0.93 x raw in scenario 1';
    // Each round runs every library once, back to back: the spread of one round's ratio shows the noise.
    const spread = (rows: Record<string, Row> | undefined) => spreadOf(rows?.['nestjs-locked']?.runs as number[] | undefined, rows?.raw?.runs as number[] | undefined);
    const s1 = spread(r.sequential);
    const s2 = spread(r.concurrent);
    const spreads = [missed1 && s1 ? `${s1} (scenario 1)` : '', missed2 && s2 ? `${s2} (scenario 2)` : ''].filter(Boolean);
    text += spreads.length ? `; within this run one round's ratio went from ${spreads.join(' and ')}, and the targets read the median.` : '.';
    lines.push(text);
    const decision = missed1 ? whatScenario1Needs(r, e) : undefined;
    if (decision) lines.push(decision);
  }
  if (r.contended) {
    const readings = Object.entries(r.contended).map(([topology, rows]) => {
      const sticks = yardsticks(r, topology, rows);
      const [, ...pings] = sticks;
      // Each mode's handoff against each yardstick, by its median round.
      const ratios = (kind: string) => sticks.map(({ row: base }) => p50Ratio(r, rows[kind]!, base));
      const fair = ratios('nestjs-locked-fair');
      const plain = ratios('nestjs-locked');
      // One cell per yardstick: the ratio, met or missed, and how far one round's ratio moved.
      const cells = (kind: string, of: number[]) =>
        sticks.map(({ row: base }, i) => {
          const range = r.contendedRounds ? rangeOf(rows[kind]!.runs as number[] | undefined, base.runs as number[] | undefined) : undefined;
          return `${of[i]!.toFixed(2)} x, ${check(of[i]! <= 2)}${range ? `; rounds ${range}` : ''}`;
        });
      const missed = [...fair, ...plain].some((ratio) => ratio > 2);
      // The raw limit's own handoff against each PING reading of this topology.
      const rawVsPing = pings.map(({ name, row: base }) => ({ name, ratio: p50Ratio(r, rows.raw!, base) }));
      const rawCells = sticks.map(({ row: base }) => (base === rows.raw ? '1.00 x' : `${p50Ratio(r, rows.raw!, base).toFixed(2)} x`));
      // Each library's own p50s (of its median round), and its release's when the run recorded releases.
      const releases = recordsReleases(rows);
      const own = (kind: string) => [String(rows[kind]!.handoffP50Ms), ...(releases ? [String(rows[kind]!.releaseP50Ms ?? '-')] : [])];
      return {
        topology,
        missed,
        rawVsPing,
        header: ['handoff p50 ms', ...(releases ? ['release p50 ms'] : []), ...sticks.map(({ name }) => `vs ${name}`)],
        rows: [
          [topology, 'fair mode', ...own('nestjs-locked-fair'), ...cells('nestjs-locked-fair', fair)],
          [topology, 'default mode', ...own('nestjs-locked'), ...cells('nestjs-locked', plain)],
          [topology, 'the raw limit itself', ...own('raw'), ...rawCells],
        ],
      };
    });
    // One table when every topology has the same yardsticks (every run so far), else one per topology.
    const sameHeader = readings.every((reading) => reading.header.join() === readings[0]!.header.join());
    const tableOf = (group: typeof readings) => [
      `  | topology | handoff of | ${group[0]!.header.join(' | ')} |`,
      `  |---|---|${group[0]!.header.map(() => '---').join('|')}|`,
      ...group.flatMap((reading) => reading.rows.map((cells) => `  | ${cells.join(' | ')} |`)),
    ];
    const readingsTable = sameHeader ? tableOf(readings) : readings.flatMap((reading, i) => [...(i > 0 ? [''] : []), ...tableOf([reading])]);
    // The PING readings the raw limit stays within 2 x of in every topology, and those it misses in some.
    const pingNames = [...new Set(readings.flatMap((reading) => reading.rawVsPing.map(({ name }) => name)))];
    const within = pingNames.filter((name) => readings.every((reading) => reading.rawVsPing.some((p) => p.name === name && p.ratio <= 2)));
    const beyond = pingNames.filter((name) => !within.includes(name));
    const rawAgainstPing =
      beyond.length === 0
        ? 'stays within 2 x PING'
        : within.length === 0
          ? 'does not come within 2 x PING either'
          : `stays within 2 x ${within.join(' and ')}, but not within 2 x ${beyond.join(' and ')}`;
    // The releases' own round trips (recorded since 2026-11-25): the first hop of every handoff.
    const releaseReadings = Object.entries(r.contended).flatMap(([topology, rows]) => {
      const one = r.contendedPingOneCaller?.[topology];
      const raw = rows.raw?.releaseP50Ms;
      if (raw === undefined || !one) return [];
      const vsPing = Number(raw) / Number(one.p50Ms);
      return [
        {
          vsPing,
          text: `${vsPing.toFixed(1)} x PING with one caller in ${topology}`,
        },
      ];
    });
    const releaseText = releaseReadings.length
      ? `The release alone, from its start to its reply (the table's release p50), took the raw limit ${releaseReadings.map((reading) => reading.text).join(' and ')}` +
        (releaseReadings.every((reading) => reading.vsPing > 2)
          ? ': the raw limit\'s compare-and-delete alone already takes longer than 2 PING round trips with one caller, and a handoff through Redis takes at least a release and the reply or message that tells the next holder, about one such round trip. '
          : '. ')
      : '';
    if (readings.some((reading) => reading.missed)) {
      lines.push(
        `- **Scenario 3, handoff <= 2 x "the raw Redis round trip".** The issues leave the round trip open: the raw limit's own handoff, or PING, which the issue's raw limit measures "at the same concurrency" (8 callers here) and scenario 1 with one caller; this run checks all three, each ${r.contendedRounds ? 'by the median of the per-round ratios, with how far one round\'s ratio moved' : 'by the ratio of the medians'}, in the table under this paragraph.` +
          '\n  - **Fair mode** hands the lock over inside the release script: the next waiter in the queue is the holder when the release returns, and learns it from the release reply (same process) or the release message, without a round trip of its own.' +
          '\n  - **Default mode** lets any newcomer take a free lock (that is what makes it unfair, and cheaper when uncontended), so its release frees the lock instead of handing it over, except to a waiter of its own process. A release takes a waiter of the releasing process along, for at most 4 releases of a key in a row (the next one wakes waiters by its message only, so that other processes get their chance): the release script itself makes an exclusive waiter the holder when it frees the lock, and the waiter learns it from the release reply, without a command of its own (one hop, as in fair mode; read-write waits and replica confirmation send their attempt right behind the release instead). A waiter in another process still takes two hops: the release message, then its own acquire round trip. Handing the lock over inside Redis to waiters of other processes too would have a price: a waiter that crashed after it was queued holds a handed-over lock until its handover lease ends (up to fairQueueTimeoutMs), where today a crashed waiter costs the others nothing (a waiter handed the lock lives in the process that released it).' +
          `\n  - **Against PING.** From the moment the holder starts its release, even one hop spans the release round trip and the message to the waiter, and the raw limit itself (a client spinning on SET NX with no delay, keeping Redis and its process busy) ${rawAgainstPing} in this run; in two processes the next waiter may be in the other process, which learns of the handover from the release message and wakes from sleep to take it, where in one process the releaser itself hands it on from the release reply; a waiter that sleeps while the lock is held pays for waking Redis and its process again after the 1 ms hold (PING in a tight loop never sleeps). ${releaseText}` +
          '\n  - **Earlier runs.** How each change of the library and the state of the machine moved these ratios, run by run: "Earlier runs" below (scenario 3, handoff ratios).',
        '',
        ...readingsTable,
        // A table ends at a blank line: the next item must not read as one of its rows.
        '',
      );
    }
  }
  if (r.http && rel(r.http.locked!, r.http.manual!, 'requestsPerSec') < 0.9) {
    const h = r.http;
    const rounds = spreadOf(h.locked?.runs as number[] | undefined, h.manual?.runs as number[] | undefined);
    lines.push(
      '- **Scenario 4, @Locked against the hand-written lock.** ' +
        (h.service ? `LockService.run() inside the handler served ${xr(rel(h.service, h.manual!, 'requestsPerSec'))} the hand-written lock's requests/s and @Locked ${xr(rel(h.locked!, h.manual!, 'requestsPerSec'))}.` : '') +
        '\n  - **What the gap was.** Profiling showed that most of the gap was the Nest interceptor @Locked used to apply to every handler (the LockInterceptor-only row: Nest wraps every call of a handler that has interceptors in rxjs, whatever the interceptor does); since 2026-11-23 @Locked gets the call site as an extra parameter instead (README, "How it is built"), which moved @Locked from 0.70 x to 0.86 x in a `BENCH_ONLY=4` run.' +
        (e.profileHttp?.locked?.appCpuVsManual !== undefined && e.profileHttp.service?.appCpuVsManual !== undefined
          ? `\n  - **What is left** is the lock's own work, in the app and in Redis: in \`npm run bench:profile\` (scenario 4 there: CPU time per request, each endpoint against the hand-written lock of the same round), an @Locked request costs the app's process ${xr(e.profileHttp.locked.appCpuVsManual)} and Redis ${xr(e.profileHttp.locked.redisCpuVsManual!)} what a hand-written one costs, and LockService.run() in the handler ${xr(e.profileHttp.service.appCpuVsManual)} and ${xr(e.profileHttp.service.redisCpuVsManual!)}: the decorator adds nothing measurable to the lock, and the lock costs more than SET NX in both processes (scenario 1; scenario 2 makes up for it by writing many callers' commands together, which requests that each start in their own turn of the event loop share little of), on the same 2 cores as the app and autocannon. (An earlier profile, 7 rounds compared by their medians, had read the app's CPU per request as equal: the medians moved more than the difference.)`
          : '\n  - **What is left:** our lock costs more Node and Redis work than SET NX (scenario 1).') +
        '\n  - **Noise.**' +
        (rounds ? ` Within this run one round's ratio went from ${rounds}.` : '') +
        ' Earlier runs of this scenario, and paired runs that tell the library\'s speed apart from the machine\'s: "Earlier runs" below (scenario 4).',
    );
  }
  // Sub-bullets start on lines of their own: no sentence's trailing space is left before them.
  return lines.map((line) => line.replace(/ +\n/g, '\n'));
}

/** ": in this run, the raw limit's own slices in scenario 1 went from A to B pairs/s", or nothing without slices. */
function spanOf(raw: Row | undefined): string {
  const runs = raw?.runs as number[] | undefined;
  return runs?.length ? `: in this run, the raw limit's own slices in scenario 1 went from ${fmt(Math.min(...runs))} to ${fmt(Math.max(...runs))} pairs/s` : '';
}

/** Each round's ratio of `ours` to `base`; undefined when the rounds do not pair up. */
function roundRatios(ours: number[] | undefined, base: number[] | undefined): number[] | undefined {
  if (!ours || !base || ours.length !== base.length || ours.length === 0) return undefined;
  return ours.map((v, i) => v / base[i]!);
}

/** The lowest and highest round-by-round ratio of `ours` to `base` ("0.71 to 1.16"); undefined when the rounds do not pair up. */
function rangeOf(ours: number[] | undefined, base: number[] | undefined): string | undefined {
  const ratios = roundRatios(ours, base);
  return ratios && `${Math.min(...ratios).toFixed(2)} to ${Math.max(...ratios).toFixed(2)}`;
}

/** `rangeOf` and the median ("0.71 to 1.16, median 0.93"); undefined when the rounds do not pair up. */
function spreadOf(ours: number[] | undefined, base: number[] | undefined): string | undefined {
  const range = rangeOf(ours, base);
  return range && `${range}, median ${median(roundRatios(ours, base)!).toFixed(2)}`;
}

function profileSection(r: Results, e: Extras): string[] {
  if (!e.profile && !e.instructions && !e.profileHttp) return [];
  // Files written before 2026-12-07 do not say how they were run: they were all run this way.
  const httpCommand = e.measured.profileHttp?.command?.replace(/ ?npm run bench:profile$/, '') ?? 'PROFILE_SCENARIOS=4 PROFILE_ROUNDS=15';
  const httpRounds = Number(/PROFILE_ROUNDS=(\d+)/.exec(httpCommand)?.[1] ?? 5);
  const out = ['## Where the time goes (profiling)', ''];
  if (e.instructions) {
    const i = e.instructions.instructionsPerPair;
    const before = Object.keys(i).flatMap((name) => /^nestjs-locked scripts at (\w+)$/.exec(name)?.[1] ?? []);
    out.push(
      `\`npm run bench:instructions\` (with \`INSTRUCTIONS_BREAKDOWN=1${before.length ? ` INSTRUCTIONS_BEFORE=${before.join(',')}` : ''}\`): redis-server's instructions per acquire + release pair, counted by valgrind's callgrind over ${fmt(e.instructions.pairs)} pairs on fresh keys. Unlike times, the count does not move with the load of the machine. Kernel time (socket reads and writes) is not counted.`,
      '',
      '| pair | instructions | vs raw |',
      '|---|---|---|',
      ...Object.entries(i).map(([name, count]) => `| ${name} | ${fmt(count)} | ${(count / i.raw!).toFixed(2)}x |`),
      '',
    );
  }
  if (e.profile) {
    out.push(
      '`npm run bench:profile`: cost per acquire + release pair, medians of 7 interleaved rounds; `scripts` is our two Lua scripts sent from a bare ioredis client (no LockService). Node CPU includes ioredis and the socket system calls. `PROFILE_CPU=1` adds a V8 CPU profile of the nestjs-locked runs.',
      '',
      '| scenario | lock | code | pairs/s | vs raw | Node CPU us/pair | Redis CPU us/pair | Redis commands/pair (in scripts too) |',
      '|---|---|---|---|---|---|---|---|',
    );
    for (const [label, data] of [['before (f2eca20)', e.profileBefore], ['now', e.profile]] as const) {
      if (!data) continue;
      for (const [scenario, kinds] of Object.entries(data)) {
        for (const [kind, c] of Object.entries(kinds)) {
          out.push(`| ${scenario} | ${kind} | ${label} | ${fmt(c.pairsPerSec)} | ${x(c.pairsPerSec, kinds.raw!.pairsPerSec)} | ${c.nodeCpuUsPerPair} | ${c.redisCpuUsPerPair} | ${c.redisCommandsPerPair} |`);
        }
      }
    }
    out.push(
      '',
      'What changed after profiling (2026-11-23): the fencing counter takes one SET ... GET instead of GET + SET, a release reads the hold count with one HGET instead of HEXISTS + HINCRBY (14 to 12 Redis commands per pair, about 7 % fewer redis-server instructions), and LockService creates a lock\'s AbortController only when its signal is read and builds events only when someone subscribed. Scenario 4: @Locked handlers get their call site as an extra parameter instead of going through LockInterceptor (Nest\'s interceptor machinery measured 25 us per request), which moved @Locked from 0.70 x to 0.86 x the hand-written lock in a `BENCH_ONLY=4 npm run bench` run. Later the same day (after 1449cac): the scripts pass Redis no Lua numbers (Lua turns each into a string with sprintf; the fencing token is now joined from the digits of TIME, a lease or hold count passed as the string it came in as), and a release asks EXISTS once for the lock and its fair queue (12 to 11 commands per pair): 10 % fewer redis-server instructions per pair (the callgrind table). The before and now profiles are two runs minutes apart, not interleaved: compare each row with its own raw row. On 2026-11-24 the lock connection started batching its socket writes (README, "Write batching"; the now rows have it, the scripts rows, sent from a bare client, do not): with 64 workers, Node and Redis CPU per pair fell below the raw limit\'s, as each write and each Redis read now carries up to 8 commands. Later that day a command sent while its connection has nothing in flight was written at once instead of waiting for the immediate (scenario 1 of `BENCH_REPEATS=3 BENCH_ONLY=1,2,4 npm run bench`: 0.80 and 0.80 x raw in two runs, 0.76 x in the run before; scenario 4: 0.99 and 0.99 x the hand-written lock, 0.93 x before).',
      '',
      ...(e.profileHttp
        ? [
            `Scenario 4 in \`npm run bench:profile\` (\`${httpCommand}\`, bench/results/profile-http.json): the same HTTP endpoints${measuredWhere(e.measured.profileHttp, r)}, medians of ${httpRounds} interleaved rounds of 3 s, with the CPU time each request costs the app's process (process.cpuUsage, kernel time included) and Redis (INFO cpu); the last two columns compare each endpoint with the hand-written lock of the same round (the median of the ${httpRounds} per-round ratios), which the load of the machine moves far less than the medians.`,
            '',
            '| endpoint | requests/s | vs hand-written lock | app CPU us/request | Redis CPU us/request | app CPU vs hand-written lock, round by round | Redis CPU vs hand-written lock, round by round |',
            '|---|---|---|---|---|---|---|',
            ...Object.entries(e.profileHttp).map(
              ([endpoint, c]) =>
                `| ${HTTP_LABELS[endpoint] ?? endpoint} | ${fmt(c.requestsPerSec)} | ${x(c.requestsPerSec, e.profileHttp!.manual!.requestsPerSec)} | ${c.appCpuUsPerRequest} | ${c.redisCpuUsPerRequest} | ${c.appCpuVsManual === undefined ? '' : xr(c.appCpuVsManual)} | ${c.redisCpuVsManual === undefined ? '' : xr(c.redisCpuVsManual)} |`,
            ),
            '',
          ]
        : []),
      'Measured and not adopted: Redis 7 functions (`FCALL`) instead of `EVALSHA` save 4 % of redis-server instructions per pair (callgrind, the same bodies: 104,747 vs 109,487; empty bodies 41,638 vs 46,077), not enough to pay for `FUNCTION LOAD` on every node, its persistence and the services that restrict it. Batching all of a turn\'s socket writes of the lock connection into one write, uncorked on the next tick (2026-11-23), read 0.93 x to 1.17 x of no batching across runs in scenario 2, and 1.0 x over 40 short paired rounds: not reliably better, as Node and Redis then take turns (Node writes the whole batch, Redis runs all of it, Node reads all the replies), each waiting while the other works. Adopted on 2026-11-24 instead: one write per 8 commands (README, "Write batching"), so that Redis runs the first 8 while Node produces the next; scenario 2 went from 0.85 x raw (the full run before, 2026-11-24) to 1.63 x in a full run uncorked on the next tick, and scenario 4 stayed at 0.86 x there (each request is read in its own I/O callback, and the next tick comes after each); uncorked by setImmediate instead, after every I/O callback of the pass, the commands of requests read together share writes too (the figures above).',
      '',
    );
  }
  return out;
}
