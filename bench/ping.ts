// PING round trips, the raw limit's yardstick for latency: shared by scenario 1 (one caller, in
// bench/run.ts) and scenario 3 (its contenders' concurrency, in each bench/contender.ts child).
import type { Redis } from 'ioredis';
import { percentile, round, timedLoops } from './stats.js';

/**
 * `warmUp` PINGs one after another, then `callers` loops at once, each sending `count` PINGs one
 * after another on `client`. Resolves to each timed round trip's latency in ms and how long the
 * timed part took (the warm-up left out).
 */
export async function timedPings(client: Redis, callers: number, count: number, warmUp: number): Promise<{ latencies: number[]; elapsedMs: number }> {
  for (let i = 0; i < warmUp; i++) await client.ping();
  return timedLoops(callers, count, () => client.ping());
}

/** The figures reported for PING round trips: their rate over `elapsedMs`, and latency p50 and p99. */
export function pingFigures(latencies: number[], elapsedMs: number): { pingsPerSec: number; p50Ms: number; p99Ms: number } {
  return { pingsPerSec: round((latencies.length / elapsedMs) * 1000, 0), p50Ms: round(percentile(latencies, 50), 3), p99Ms: round(percentile(latencies, 99), 3) };
}
