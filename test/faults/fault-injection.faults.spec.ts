import { afterAll, beforeAll, describe, expect, it } from '@jest/globals';
import type { Redis } from 'ioredis';
import { performance } from 'node:perf_hooks';
import { Fixture, type FixtureMessage } from '../support/children.js';
import { expectedServer, RedisServer, serverIdentity } from '../support/redis-server.js';

/**
 * The fault suite (`npm run test:faults`): processes contend for a few keys with nested
 * acquisitions, random holds and random aborts, while faults are injected into the lock Redis and
 * into the processes. The protected counter lives on a second Redis that is never faulted, written
 * by a fenced compare-and-set, so the checks below judge the lock and nothing else.
 */
const LEASE = 1_000;
/**
 * Fair places (key k0) lapse after this long without an attempt; a handover lasts at most this long.
 * It is the lease: the handover lease (min(lease, this)) is counted from the waiter's last attempt,
 * which may come up to half of it before the release, so a lock just handed over may have only half
 * of it left when its first renewal is sent. With 500 ms that was 250 ms, less than the 300 ms
 * CLIENT PAUSE below: the holder rightly counted the lock lost at its deadline (seen in CI on
 * Valkey, and here about once in 12 runs under load). With 1 s both margins (two thirds of the
 * lease for a renewed lock, half the handover lease for a handed-over one) are above the pause, as
 * the README states.
 */
const FAIR_QUEUE_TIMEOUT_MS = LEASE;
const KEYS = 3;
/** CLOCK_MONOTONIC in ms: the same clock in every process on this machine (the workers use it too). */
const clock = () => Number(process.hrtime.bigint()) / 1e6;

describe('fault injection', () => {
  let lockRedis: RedisServer;
  let resourceRedis: RedisServer;
  let resource: Redis;
  const children = new Map<string, Fixture>();
  const killed = new Map<string, number>(); // child name -> when it was SIGKILLed
  const pids: number[] = [];
  let started = 0;
  let spawned = 0;
  /** When the lock Redis was killed and when its replacement was ready (it forgot every lock). */
  let dataLoss: { killedAt: number; readyAt: number } | undefined;

  const spawn = async () => {
    const name = `p${++spawned}`;
    const child = new Fixture('fault-worker', [lockRedis.url, resourceRedis.url, String(KEYS), String(LEASE), name, String(FAIR_QUEUE_TIMEOUT_MS)]);
    children.set(name, child);
    const ready = await child.next('ready');
    pids.push(Number(ready.pid));
    return name;
  };
  const all = (): (FixtureMessage & { child: string })[] =>
    [...children.entries()].flatMap(([name, c]) => c.messages.map((m) => ({ ...m, child: name })));
  const after = (t: number) => (m: FixtureMessage) => Number(m.at) > t;
  /** The next message of `type` from any live child other than `except`. */
  const nextFromAny = (type: string, where: (m: FixtureMessage) => boolean, except?: string, ms = 15_000) =>
    Promise.race([...children.entries()].filter(([n]) => n !== except && !killed.has(n)).map(([, c]) => c.next(type, where, ms)));

  beforeAll(async () => {
    started = performance.now();
    lockRedis = await RedisServer.start();
    resourceRedis = await RedisServer.start();
    resource = resourceRedis.client();
    pids.push(lockRedis.pid!, resourceRedis.pid!);
    for (let i = 0; i < 3; i++) await spawn();
    // Let them contend for a while before the first fault.
    await nextFromAny('exit', (m) => Number(m.wrote) === 1);
  });

  afterAll(async () => {
    await Promise.all([...children.values()].map((c) => c.stop()));
    await lockRedis?.stop();
    await resourceRedis?.stop();
  });

  it('runs on the server this run names (LOCK_TEST_SERVER in the Redis 8 and Valkey 8 runs, else the redis-server on the PATH)', async () => {
    expect(await serverIdentity(lockRedis.shared())).toBe(expectedServer());
    expect(await serverIdentity(resourceRedis.shared())).toBe(expectedServer());
  });

  it('SIGKILL a holder: another process gets its key within the lease plus a small margin', async () => {
    const [name, victim] = [...children.entries()][0]!;
    const since = clock();
    victim.send({ type: 'hold', ms: 60_000 });
    const holding = await victim.next('holding', after(since));
    victim.kill('SIGKILL');
    const killedAt = clock();
    killed.set(name, killedAt);
    await victim.exited;
    const taken = await nextFromAny('enter', (m) => m.key === holding.key && Number(m.at) > killedAt, name);
    // k0 is fair: the killed process's other worker may be queued there too, and be handed the lock
    // once before its place lapses, which stalls the line for at most twice the queue timeout.
    expect(Number(taken.at) - killedAt).toBeLessThan(LEASE + 500 + (holding.key === 'k0' ? 2 * FAIR_QUEUE_TIMEOUT_MS : 0));
    await spawn();
  });

  it('SIGSTOP a holder past its lease: on SIGCONT its signal has aborted before its protected step, which is skipped', async () => {
    const [name, victim] = [...children.entries()].find(([n]) => !killed.has(n))!;
    const since = clock();
    victim.send({ type: 'hold', ms: 50 });
    const holding = await victim.next('holding', after(since));
    process.kill(victim.pid, 'SIGSTOP');
    const stoppedAt = clock();
    // Its lease runs out; another process takes the key while it is frozen.
    await nextFromAny('enter', (m) => m.key === holding.key && Number(m.at) > stoppedAt, name);
    process.kill(victim.pid, 'SIGCONT');
    const exit = await victim.next('exit', (m) => m.id === holding.id);
    expect(exit).toMatchObject({ aborted: true, wrote: 0 });
    await victim.next('lost', (m) => m.key === holding.key && Number(m.at) > stoppedAt);
    // ...and it goes on working.
    const resumed = clock();
    await victim.next('exit', (m) => Number(m.at) > resumed && Number(m.wrote) === 1);
  });

  it('block a holder\'s event loop past its lease: loss is signalled when it resumes, and the process lives on', async () => {
    const [name, victim] = [...children.entries()].find(([n]) => !killed.has(n))!;
    const since = clock();
    victim.send({ type: 'block', ms: LEASE + 500 });
    const blocking = await victim.next('blocking', after(since));
    const exit = await victim.next('exit', (m) => m.id === blocking.id);
    expect(exit).toMatchObject({ aborted: true, wrote: 0 });
    const resumed = clock();
    await victim.next('exit', (m) => Number(m.at) > resumed && Number(m.wrote) === 1);
    expect(killed.has(name)).toBe(false);
  });

  it('CLIENT PAUSE shorter than what is left of every lease when its renewal is sent: no lock is lost', async () => {
    const live = [...children.entries()].filter(([n]) => !killed.has(n));
    const since = clock();
    for (const [, c] of live) c.send({ type: 'hold', ms: 1_200 });
    await Promise.all(live.map(([, c]) => c.next('holding', after(since))));
    const raw = lockRedis.client();
    const pausedAt = clock();
    await raw.call('CLIENT', 'PAUSE', '300', 'ALL');
    // Let a whole lease pass: every renewal due meanwhile is delayed by the pause, none is missed
    // (see FAIR_QUEUE_TIMEOUT_MS for the margins).
    await Promise.all(live.map(([, c]) => c.next('exit', (m) => Number(m.at) > pausedAt + 1_100, 15_000)));
    const losses = all().filter((m) => m.type === 'lost' && Number(m.at) > pausedAt);
    expect(losses.map((m) => `${m.child} ${m.key} ${m.reason} ${Math.round(Number(m.at) - pausedAt)} ms after the pause began`)).toEqual([]);
  });

  it('restart redis-server mid-hold: holders are told they lost their locks, then everything works again', async () => {
    const live = [...children.entries()].filter(([n]) => !killed.has(n));
    const since = clock();
    for (const [, c] of live) c.send({ type: 'hold', ms: 4_000 });
    // Children may queue behind each other on a shared key: judge those inside their hold at the kill.
    const holders: { child: Fixture; holding: FixtureMessage }[] = [];
    const arrivals = live.map(([, c]) => c.next('holding', after(since)).then((holding) => holders.push({ child: c, holding }), () => undefined));
    await Promise.race(arrivals);
    await new Promise((r) => setTimeout(r, 200)); // a moment for more holders to come in
    const inside = [...holders];
    const killedAt = clock();
    await lockRedis.kill();
    const restartedAt = clock();
    await lockRedis.launch();
    dataLoss = { killedAt, readyAt: clock() };
    pids.push(lockRedis.pid!);
    expect(inside.length).toBeGreaterThan(0);
    for (const { child, holding } of inside) {
      const exit = await child.next('exit', (m) => m.id === holding.id);
      expect(exit).toMatchObject({ aborted: true, wrote: 0 });
      await child.next('lost', (m) => m.key === holding.key && Number(m.at) > restartedAt);
    }
    await nextFromAny('exit', (m) => Number(m.at) > restartedAt && Number(m.wrote) === 1, undefined, 20_000);
    await Promise.all(arrivals);
  });

  it('never had two owners in the critical section unless the earlier one had been told or Redis forgot its lock, and the counters are exact', async () => {
    for (const [name, c] of children) if (!killed.has(name)) c.send({ type: 'stop' });
    const live = [...children.entries()].filter(([n]) => !killed.has(n));
    await Promise.all(live.map(([, c]) => c.next('done', undefined, 30_000)));
    const exits = await Promise.all(live.map(([, c]) => c.exited));
    expect(exits.every((e) => e.code === 0)).toBe(true);
    expect(all().filter((m) => m.type === 'crash')).toEqual([]);

    // The observer: critical sections per key from enter/exit reports.
    const messages = all();
    const exitsById = new Map(messages.filter((m) => m.type === 'exit').map((m) => [m.id, m]));
    const sections = messages
      .filter((m) => m.type === 'enter')
      .map((m) => {
        const exit = exitsById.get(m.id);
        const killedAt = killed.get(m.child);
        return { id: m.id, token: m.token, key: m.key, child: m.child, enter: Number(m.at), exit: exit ? Number(exit.at) : killedAt ?? Infinity, told: exit ? exit.aborted === true : killedAt !== undefined, stale: m.stale === true, wrote: exit ? Number(exit.wrote) : 0 };
      });
    expect(sections.filter((s) => s.exit === Infinity)).toEqual([]); // every section ended (or its process was killed)
    // A section that entered with its lease already gone (its process was frozen between the grant and
    // the enter report) never was an owner when it entered: it must have been told, and written nothing.
    expect(sections.filter((s) => s.stale && (!s.told || s.wrote !== 0))).toEqual([]);
    let late = 0;
    let overlaps = 0;
    let forgotten = 0;
    const staleSections = new Set<object>();
    // A section that began before the restarted Redis was ready and ended after the kill had its
    // lock forgotten by Redis (no persistence): another owner may get in before this holder's next
    // renewal or release tells it. That is the documented limit; the fenced counter must stay exact.
    const spansDataLoss = (s: { enter: number; exit: number }) => dataLoss !== undefined && s.enter < dataLoss.readyAt && s.exit > dataLoss.killedAt;
    const untold: unknown[] = [];
    for (let k = 0; k < KEYS; k++) {
      const ordered = sections.filter((s) => s.key === `k${k}`).sort((a, b) => a.enter - b.enter);
      for (let i = 0; i < ordered.length; i++) {
        for (let j = i + 1; j < ordered.length && ordered[j]!.enter < ordered[i]!.exit; j++) {
          overlaps++;
          staleSections.add(ordered[i]!);
          if (!ordered[i]!.told && spansDataLoss(ordered[i]!)) {
            forgotten++;
            continue;
          }
          if (!ordered[i]!.told && ordered[j]!.stale) {
            late++;
            continue;
          }
          if (!ordered[i]!.told) untold.push({ earlier: ordered[i], later: ordered[j] });
        }
      }
      // The protected counter is exact: one accepted increment per log entry, none lost.
      expect(Number((await resource.get(`c:k${k}`)) ?? 0)).toBe(await resource.llen(`log:k${k}`));
    }
    // On failure: both sections of each untold overlap, the Redis-down window, and every message of the processes involved around them.
    const around = (u: any) => messages.filter((m) => (m.child === u.earlier.child || m.child === u.later.child) && Number(m.at) > u.earlier.enter - 50 && Number(m.at) < u.earlier.exit + 50);
    expect({ untold: untold.map((u) => ({ ...(u as object), messages: around(u) })), dataLoss }).toEqual({ untold: [], dataLoss });
    expect(sections.length).toBeGreaterThan(100);
    expect(overlaps).toBeGreaterThan(0); // the faults did produce overlaps, all of them told
    console.log(
      `fault suite: ${sections.length} critical sections; ${staleSections.size} stale sections ` +
        `overlapped ${overlaps} later ones (${forgotten} of them across the Redis restart, untold; ${late} reported late by a section whose lease had already run out); ${((performance.now() - started) / 1000).toFixed(1)} s`,
    );
  });

  it('leaves no process and no redis-server behind', async () => {
    await Promise.all([...children.values()].map((c) => c.stop()));
    await lockRedis.stop();
    await resourceRedis.stop();
    for (const pid of pids) expect(() => process.kill(pid, 0)).toThrow();
  });
});
