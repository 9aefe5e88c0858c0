import { cpus } from 'node:os';
import { performance } from 'node:perf_hooks';

/** Percentile (0..100) of an unsorted sample, by nearest rank. */
export function percentile(values: readonly number[], p: number): number {
  if (values.length === 0) return NaN;
  const sorted = [...values].sort((a, b) => a - b);
  const rank = Math.min(sorted.length - 1, Math.max(0, Math.ceil((p / 100) * sorted.length) - 1));
  return sorted[rank]!;
}

export const median = (values: readonly number[]) => percentile(values, 50);

/** Jain's fairness index of per-worker counts: 1 when all equal, 1/n when one worker gets everything. */
export function jain(counts: readonly number[]): number {
  const sum = counts.reduce((a, b) => a + b, 0);
  const squares = counts.reduce((a, b) => a + b * b, 0);
  return squares === 0 ? NaN : (sum * sum) / (counts.length * squares);
}

export const round = (value: number, digits = 2) => Number(value.toFixed(digits));

/**
 * `loops` loops at once, each running `op` `count` times one after another. Resolves to each
 * operation's latency in ms and how long the whole took: the timing of scenarios 1 and 2 (acquire +
 * release pairs) and of PING round trips.
 */
export async function timedLoops(loops: number, count: number, op: () => Promise<unknown>): Promise<{ latencies: number[]; elapsedMs: number }> {
  const latencies: number[] = [];
  const started = performance.now();
  await Promise.all(
    Array.from({ length: loops }, async () => {
      for (let i = 0; i < count; i++) {
        const t = performance.now();
        await op();
        latencies.push(performance.now() - t);
      }
    }),
  );
  return { latencies, elapsedMs: performance.now() - started };
}

/** The machine a run measured on, as BENCHMARKS.md names it. */
export interface Machine {
  cores: number;
  cpu?: string;
  node: string;
  redis: string;
}

/** When and where a run measured: written into each results file, so the report can say it. */
export async function measuredOn(redis: { info(section: string): Promise<string> }): Promise<{ date: string; machine: Machine }> {
  const version = /redis_version:(\S+)/.exec(await redis.info('server'))?.[1] ?? '?';
  return { date: new Date().toISOString(), machine: { cores: cpus().length, cpu: cpus()[0]?.model, node: process.version, redis: version } };
}
