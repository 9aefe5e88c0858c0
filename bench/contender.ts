// A benchmark child process with `workers` contenders on one key, driven by the parent over IPC:
// - {type:'round'}: every worker acquires once (hold ~1 ms, release); replies with the events.
//   Within a round every acquisition after the first is a handoff to a waiter. The events include
//   how long each release took (from its start to its reply: the release's round trip).
// - {type:'loop', until}: every worker loops acquire / hold / release / retry until `until` (a
//   tight loop, for fairness); replies with the events.
// - {type:'ping', count}: every worker sends `count` PINGs one after another on the process's own
//   client, all workers at once (PING round trips at the contenders' concurrency); replies with the
//   latencies in ms and how long the timed part took.
// - {type:'stop'}: closes and exits.
// Times are on a clock shared by processes (timeOrigin + now). argv: kind redisUrl key workers processIndex
import { Redis } from 'ioredis';
import { performance } from 'node:perf_hooks';
import { makeLocker, type LockerKind } from './lockers.js';
import { timedPings } from './ping.js';

const [kind, url, key, workers, processIndex] = process.argv.slice(2) as [LockerKind, string, string, string, string];
const clock = () => performance.timeOrigin + performance.now();
const hold = () => new Promise((resolve) => setTimeout(resolve, 1));
const locker = await makeLocker(kind, url);

async function once(worker: string, acquisitions: { worker: string; at: number }[], releases: number[], releaseMs: number[]) {
  const release = await locker.acquire(key);
  acquisitions.push({ worker, at: clock() });
  await hold();
  const started = clock();
  releases.push(started);
  await release();
  releaseMs.push(clock() - started);
}

let pinger: Redis | undefined;

process.on('message', async (m: { type: string; until?: number; count?: number }) => {
  const acquisitions: { worker: string; at: number }[] = [];
  const releases: number[] = [];
  const releaseMs: number[] = [];
  const ids = Array.from({ length: Number(workers) }, (_, w) => `${processIndex}:${w}`);
  if (m.type === 'round') {
    await Promise.all(ids.map((id) => once(id, acquisitions, releases, releaseMs)));
    process.send!({ type: 'events', acquisitions, releases, releaseMs });
  } else if (m.type === 'loop') {
    await Promise.all(
      ids.map(async (id) => {
        while (clock() < m.until!) {
          await once(id, acquisitions, releases, releaseMs);
          await new Promise((r) => setImmediate(r));
        }
      }),
    );
    process.send!({ type: 'events', acquisitions, releases, releaseMs });
  } else if (m.type === 'ping') {
    pinger ??= new Redis(url);
    process.send!({ type: 'pings', ...(await timedPings(pinger, ids.length, m.count!, 100)) });
  } else if (m.type === 'stop') {
    await pinger?.quit();
    await locker.close();
    process.disconnect();
  }
});
process.send!({ type: 'ready' });
