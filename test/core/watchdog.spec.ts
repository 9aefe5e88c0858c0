import { describe, expect, it } from '@jest/globals';
import { setImmediate as realSetImmediate } from 'node:timers';
import { HeldLock } from '../../lib/held-lock.js';
import type { Time, Timer } from '../../lib/internal/time.js';
import { DEADLINE_SLACK_MS, Watchdog, type WatchdogHooks } from '../../lib/renewal/watchdog.js';

/**
 * The watchdog's schedule on its own, on a clock the test moves: which timer it arms, when it
 * renews, from when a renewal's lease counts, and when it retries. The renewal.spec, fake-timers
 * and health specs test it end to end against Redis and the memory store; there, a timer armed a
 * little early or a retry a little late shows only as time. The service's hooks are replaced by
 * recorders here, and the test answers each renewal itself.
 */

interface ManualTimer extends Timer {
  at: number;
  callback: () => void;
  cleared: boolean;
  unrefed: boolean;
}

/** A clock that moves only when told, and runs the timers due by then, in order. */
class ManualTime implements Time {
  t = 0;
  readonly timers: ManualTimer[] = [];
  readonly now = (): number => this.t;
  setTimeout(callback: () => void, ms: number): Timer {
    const timer: ManualTimer = { at: this.t + ms, callback, cleared: false, unrefed: false, unref: () => (timer.unrefed = true) };
    this.timers.push(timer);
    return timer;
  }
  clearTimeout(timer: Timer): void {
    (timer as ManualTimer).cleared = true;
  }
  setImmediate(callback: () => void): void {
    realSetImmediate(callback);
  }
  /** The timers armed and not yet run or cleared. */
  get armed(): ManualTimer[] {
    return this.timers.filter((timer) => !timer.cleared);
  }
  /**
   * Moves the clock to `to`, running each timer due by then (a timer never runs twice). A timer
   * that keeps arming another for the same moment would never let time move: that fails the test.
   */
  advance(to: number): void {
    let run = 0;
    for (let due = this.next(to); due; due = this.next(to)) {
      if (++run > 100) throw new Error(`more than 100 timers ran by ${to} ms: a timer keeps arming another for ${due.at} ms`);
      this.t = due.at;
      due.cleared = true;
      due.callback();
    }
    this.t = to;
  }
  private next(to: number): ManualTimer | undefined {
    return this.armed.filter((timer) => timer.at <= to).sort((a, b) => a.at - b.at)[0];
  }
}

/** Lets the promise callbacks of an answered renewal run. */
const settle = (): Promise<void> => new Promise((resolve) => realSetImmediate(resolve));

/** The service's side: records every call; each renewal waits for the test's answer. */
function recorder() {
  const renewals: { locks: readonly HeldLock[]; answer(results: boolean[]): void; fail(error: Error): void }[] = [];
  const renewed: string[][] = [];
  const lost: [string, string][] = [];
  const failed: string[][] = [];
  const unanswered: [string[], number][] = [];
  const hooks: WatchdogHooks = {
    renew: (locks) =>
      new Promise<boolean[]>((answer, fail) => {
        renewals.push({ locks, answer, fail });
      }),
    group: () => 0,
    renewed: (locks) => void renewed.push(locks.map((l) => l.key)),
    lost: (lock, reason) => void lost.push([lock.key, reason]),
    renewFailed: (locks) => void failed.push(locks.map((l) => l.key)),
    renewUnanswered: (locks, afterMs) => void unanswered.push([locks.map((l) => l.key), afterMs]),
  };
  return { hooks, renewals, renewed, lost, failed, unanswered };
}

/** A lock with a `leaseMs` lease from `start`, renewed by the watchdog unless `watchdog` is false. */
const lock = (time: ManualTime, key: string, leaseMs: number, start = time.t, watchdog = true): HeldLock =>
  new HeldLock(key, key, 'owner', leaseMs, watchdog, 1, start, 'exclusive', undefined, false, time.now);

/** A watchdog on a fresh clock, watching one renewed lock per `[key, leaseMs, start]` (start: 0 unless given). */
function watching(...leases: [string, number, number?][]) {
  const time = new ManualTime();
  const recorded = recorder();
  const watchdog = new Watchdog(recorded.hooks, time);
  const locks = leases.map(([key, leaseMs, start = 0]) => lock(time, key, leaseMs, start));
  for (const held of locks) watchdog.add(held);
  /** The keys of each renewal call so far, in order. */
  const renewedKeys = () => recorded.renewals.map((r) => r.locks.map((l) => l.key));
  return { time, watchdog, locks, renewedKeys, ...recorded };
}

describe('Watchdog', () => {
  it('arms one unref()ed timer for locks due at the same moment, and none for a lock added once stopped', () => {
    const { time, watchdog } = watching(['a', 30_000], ['b', 30_000], ['c', 30_000]);
    expect(time.timers).toHaveLength(1);
    expect(time.armed[0]).toMatchObject({ at: 10_000, unrefed: true });
    watchdog.stop();
    expect(watchdog.size).toBe(0);
    expect(time.armed).toEqual([]);
    watchdog.add(lock(time, 'late', 30_000));
    expect(watchdog.size).toBe(0);
    expect(time.armed).toEqual([]);
  });

  it('never arms its timer before the moment something is due, when that moment falls between milliseconds', () => {
    const time = new ManualTime();
    const recorded = recorder();
    const watchdog = new Watchdog(recorded.hooks, time);
    const fixed = lock(time, 'fixed', 1_001.4, 0, false);
    watchdog.add(fixed);
    // Due a millisecond before its deadline (DEADLINE_SLACK_MS), at 1 000.4. Rounded down, the timer
    // would fire at 1 000, find nothing due, and fire again at once, all the while.
    expect(time.armed.map((timer) => timer.at)).toEqual([1_001]);
    time.advance(1_001);
    expect(recorded.lost).toEqual([['fixed', 'lease-expired']]);
    expect(time.armed).toEqual([]);
  });

  it('declares a lock lost once its deadline is within a millisecond: a timer that Node runs that much early or late must not tell the holder after Redis freed the lock', () => {
    const time = new ManualTime();
    const recorded = recorder();
    const watchdog = new Watchdog(recorded.hooks, time);
    watchdog.add(lock(time, 'fixed', 5_000, 0, false));
    expect(time.armed.map((timer) => timer.at)).toEqual([5_000 - DEADLINE_SLACK_MS]);
    // The timer runs early (Node's loop time lags by a fraction of a millisecond): 4 999.5 is within the slack.
    time.t = 4_999.5;
    time.armed[0]!.callback();
    expect(recorded.lost).toEqual([['fixed', 'lease-expired']]);
  });

  it('counts a renewal\'s lease from when it was sent, not from when its answer came', async () => {
    const { time, locks, renewals, renewed } = watching(['a', 30_000]);
    const [held] = locks as [HeldLock];
    time.advance(10_000);
    expect(renewals).toHaveLength(1);
    // While the renewal is in flight, the timer waits for the deadline (a millisecond early, see
    // DEADLINE_SLACK_MS), not for the renewal now past.
    expect(time.armed.map((timer) => timer.at)).toEqual([30_000 - DEADLINE_SLACK_MS]);
    time.advance(12_000);
    renewals[0]!.answer([true]);
    await settle();
    expect(renewed).toEqual([['a']]);
    expect(held.deadline).toBe(40_000);
    expect(held.renewAt).toBe(20_000);
  });

  it('renews with a due lock every lock due within half a renewal period, and never a lock whose renewal is in flight', () => {
    // 30 s leases: renewed a third in (10 s), batched within half of that period (5 s). Renewals
    // due at 10 000 (a), 16 000 (b), 19 000 (c: within 5 s of b's) and 22 000 (d: not).
    const { time, renewedKeys } = watching(['a', 30_000], ['b', 30_000, 6_000], ['c', 30_000, 9_000], ['d', 30_000, 12_000]);
    time.advance(16_000);
    // a's renewal is still in flight at 16 000.
    expect(renewedKeys()).toEqual([['a'], ['b', 'c']]);
  });

  it('retries a failed renewal a tenth of the lease later, and at most a second later', async () => {
    const { time, locks, renewals, renewedKeys, failed } = watching(['short', 3_000], ['long', 30_000]);
    const [short, long] = locks as [HeldLock, HeldLock];
    time.advance(1_000);
    expect(renewedKeys()).toEqual([['short']]);
    renewals[0]!.fail(new Error('down'));
    await settle();
    expect(failed).toEqual([['short']]);
    expect(short.renewAt).toBe(1_300);
    time.advance(10_000);
    // The short lock's retry is due at 1 300, the long lock's renewal at 10 000.
    expect(renewedKeys()).toEqual([['short'], ['short'], ['long']]);
    renewals[2]!.fail(new Error('down'));
    await settle();
    expect(long.renewAt).toBe(11_000);
  });

  it('says nothing of a lock removed while its renewal was in flight, whatever the answer', async () => {
    const { time, watchdog, locks, renewals, renewed, lost } = watching(['kept', 30_000], ['gone', 30_000]);
    const [kept, gone] = locks as [HeldLock, HeldLock];
    time.advance(10_000);
    watchdog.remove(kept);
    watchdog.remove(gone);
    renewals[0]!.answer([true, false]);
    await settle();
    expect(renewed).toEqual([]);
    expect(lost).toEqual([]);
    // Its lease as it was before the renewal: a released lock's record is not updated.
    expect(kept.deadline).toBe(30_000);
  });

  it('reports a renewal with no answer after unansweredAfterMs, once, for the locks still watched, and waits for it rather than sending another', async () => {
    const time = new ManualTime();
    const { hooks, renewals, renewed, failed, unanswered } = recorder();
    const watchdog = new Watchdog(hooks, time, 1_000);
    const [a, b] = [lock(time, 'a', 30_000), lock(time, 'b', 30_000)] as [HeldLock, HeldLock];
    watchdog.add(a);
    watchdog.add(b);
    time.advance(10_500);
    watchdog.remove(b);
    time.advance(10_999);
    expect(unanswered).toEqual([]);
    time.advance(11_000);
    expect(unanswered).toEqual([[['a'], 1_000]]);
    expect(time.timers.every((timer) => timer.unrefed)).toBe(true);
    // No second renewal while the first is unanswered, and no second report; its late answer, within
    // the lease, renews the lock from when it was sent.
    time.advance(20_000);
    expect(renewals).toHaveLength(1);
    expect(unanswered).toHaveLength(1);
    renewals[0]!.answer([true]);
    await settle();
    expect(renewed).toEqual([['a']]);
    expect(a.deadline).toBe(40_000);
    // Answered, or failed, within the bound: nothing reported as unanswered.
    time.advance(20_000);
    expect(renewals).toHaveLength(2);
    renewals[1]!.answer([true]);
    await settle();
    time.advance(30_000);
    expect(renewals).toHaveLength(3);
    renewals[2]!.fail(new Error('down'));
    await settle();
    time.advance(31_000);
    expect(failed).toEqual([['a']]);
    expect(unanswered).toHaveLength(1);
    watchdog.stop();
  });

  it('reports no unanswered renewal of locks lost or released before the bound', async () => {
    const time = new ManualTime();
    const { hooks, renewals, lost, unanswered } = recorder();
    const watchdog = new Watchdog(hooks, time, 5_000);
    const held = lock(time, 'short', 3_000);
    watchdog.add(held);
    time.advance(1_000);
    expect(renewals).toHaveLength(1);
    time.advance(10_000);
    expect(lost).toEqual([['short', 'lease-expired']]);
    expect(unanswered).toEqual([]);
    watchdog.stop();
  });
});
