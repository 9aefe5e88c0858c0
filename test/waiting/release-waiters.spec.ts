import { afterEach, beforeEach, describe, expect, it } from '@jest/globals';
import type { Handover, ReleaseWatch } from '../../lib/store/lock-store.js';
import { realTime, type Time } from '../../lib/internal/time.js';
import { MAX_HANDOFFS_IN_A_ROW, ReleaseWaiters } from '../../lib/waiting/release-waiters.js';
import { PENDING, settled } from '../support/lock-testing.js';

/**
 * The bookkeeping of one process's waiters, which decides which waiter a release wakes: on its
 * own, with no Redis, because none of it reaches Redis. The stores feed it (the Redis store from
 * its release channel, the memory store directly), and the waiting, handoff and fair specs test
 * the same paths end to end against Redis. There, a wake that goes to the wrong waiter, or is
 * lost, only costs time: the waiter retries at its lease-bounded timeout. Here it is seen at once.
 */

/** A long timeout: every sleep here ends by a wake or by close(), never by its timer. */
const LONG = 60_000;

describe('ReleaseWaiters', () => {
  let waiters: ReleaseWaiters;
  let watches: ReleaseWatch[] = [];
  const join = (owner: string, handoverLeaseMs?: number): ReleaseWatch => {
    const watch = waiters.join('k', owner, Promise.resolve(true), undefined, handoverLeaseMs);
    watches.push(watch);
    return watch;
  };
  afterEach(() => {
    for (const watch of watches) watch.close();
    watches = [];
  });
  beforeEach(() => {
    waiters = new ReleaseWaiters();
  });

  it(`takes a sleeping waiter along at most ${MAX_HANDOFFS_IN_A_ROW} releases in a row, then wakes nobody early once, then starts again`, async () => {
    const sleeper = join('a', 1_000);
    const taken: boolean[] = [];
    for (let release = 0; release < 2 * (MAX_HANDOFFS_IN_A_ROW + 1); release++) {
      const sleep = sleeper.sleep(LONG);
      const along = waiters.wakeBehindRelease('k');
      taken.push(along !== undefined);
      if (along) {
        expect(along.owner).toBe('a');
        expect(along.leaseMs).toBe(1_000);
        expect(along.wake()).toBe(true);
      } else {
        // Its message wakes the waiter, here as in any other process.
        waiters.notify('k');
      }
      expect(await settled(sleep)).toBe('released');
    }
    const round = [...Array.from({ length: MAX_HANDOFFS_IN_A_ROW }, () => true), false];
    expect(taken).toEqual([...round, ...round]);
  });

  it('takes along the longest-waiting waiter that sleeps, past one busy with an attempt', async () => {
    join('busy'); // joined first, not asleep
    const sleeper = join('asleep');
    const sleep = sleeper.sleep(LONG);
    const along = waiters.wakeBehindRelease('k');
    expect(along?.owner).toBe('asleep');
    expect(along?.leaseMs).toBeUndefined();
    expect(along!.wake()).toBe(true);
    expect(await settled(sleep)).toBe('released');
  });

  it('takes nobody along where nobody sleeps, and reports a taken-along waiter that stopped sleeping before its wake', async () => {
    const waiter = join('a');
    expect(waiters.wakeBehindRelease('k')).toBeUndefined();
    const sleep = waiter.sleep(LONG);
    const along = waiters.wakeBehindRelease('k');
    waiter.close();
    expect(await settled(sleep)).toBe('aborted');
    // The store gives back a grant the release may have handed it.
    expect(along!.wake()).toBe(false);
  });

  it('keeps the release message for the waiter taken along: no second waiter wakes, and that waiter retries at once if its attempt is refused', async () => {
    const first = join('first');
    const second = join('second');
    const firstSleep = first.sleep(LONG);
    const secondSleep = second.sleep(LONG);
    waiters.wakeBehindRelease('k')!.wake();
    expect(await settled(firstSleep)).toBe('released');
    // The release's own message arrives while the first waiter's attempt is in flight.
    waiters.notify('k');
    expect(await settled(secondSleep)).toBe(PENDING);
    expect(waiters.asleep('k')).toBe(1);
    // Its attempt was refused (another process got in first): the kept message ends its next sleep.
    expect(await settled(first.sleep(LONG))).toBe('released');
    // Kept once: the sleep after that waits for a release of its own.
    expect(await settled(first.sleep(LONG))).toBe(PENDING);
  });

  it('hands a taken-along waiter the verdict of the release that woke it, once: a later sleep forgets it', async () => {
    const waiter = join('a', 1_000);
    const sleep = waiter.sleep(LONG);
    const verdict: Promise<Handover | undefined> = Promise.resolve({ fencingToken: 7, leaseStart: 0 });
    waiters.wakeBehindRelease('k')!.wake(verdict);
    expect(await settled(sleep)).toBe('released');
    expect(waiter.takeHandover!()).toBe(verdict);
    expect(waiter.takeHandover!()).toBeUndefined();
    // Not taken before its next sleep (its attempt went ahead instead): that sleep forgets it.
    const again = waiter.sleep(LONG);
    waiters.wakeBehindRelease('k')!.wake(verdict);
    expect(await settled(again)).toBe('released');
    void waiter.sleep(LONG);
    expect(waiter.takeHandover!()).toBeUndefined();
  });

  it('keeps a release that found nobody asleep for the next waiters to sleep, one per waiter at most', async () => {
    const first = join('first');
    const second = join('second');
    // Both busy with attempts: three releases are noticed, but two waiters can use two of them.
    waiters.notify('k');
    waiters.notify('k');
    waiters.notify('k');
    expect(await settled(first.sleep(LONG))).toBe('released');
    expect(await settled(second.sleep(LONG))).toBe('released');
    expect(await settled(first.sleep(LONG))).toBe(PENDING);
  });

  it('drops the kept releases a leaving waiter can no longer use', async () => {
    const staying = join('staying');
    const leaving = join('leaving');
    waiters.notify('k');
    waiters.notify('k');
    leaving.close();
    expect(await settled(staying.sleep(LONG))).toBe('released');
    expect(await settled(staying.sleep(LONG))).toBe(PENDING);
  });

  it('passes a wake on to the next sleeper when the woken waiter leaves without trying again', async () => {
    const woken = join('woken');
    const next = join('next');
    const wokenSleep = woken.sleep(LONG);
    const nextSleep = next.sleep(LONG);
    waiters.notify('k');
    expect(await settled(wokenSleep)).toBe('released');
    expect(await settled(nextSleep)).toBe(PENDING);
    woken.close(true);
    expect(await settled(nextSleep)).toBe('released');
  });

  it('keeps a wake addressed to a waiter that is busy for its next sleep: a fair release to its owner, and a read-write change', async () => {
    const waiter = join('a');
    waiters.notifyOwner('k', 'a');
    expect(await settled(waiter.sleep(LONG))).toBe('released');
    waiters.notifyEveryone('k');
    expect(await settled(waiter.sleep(LONG))).toBe('released');
    expect(await settled(waiter.sleep(LONG))).toBe(PENDING);
  });

  it('ends a sleep with granted for a fair grant to its wait, now or at its next sleep, and once per grant', async () => {
    const waiter = join('a');
    // Busy: kept for its next sleep.
    waiters.grant('k', 'a', waiter.waitId, 5);
    expect(await settled(waiter.sleep(LONG))).toBe('granted');
    expect(waiter.grantedToken).toBe(5);
    // The same grant again (the releaser's reply and the release message both report it): ignored.
    const sleep = waiter.sleep(LONG);
    waiters.grant('k', 'a', waiter.waitId, 5);
    expect(await settled(sleep)).toBe(PENDING);
    waiters.grant('k', 'a', waiter.waitId, 6);
    expect(await settled(sleep)).toBe('granted');
    expect(waiter.grantedToken).toBe(6);
  });

  it('forgets a kept grant up to the token a refused attempt saw, and keeps a later one', async () => {
    const waiter = join('a');
    waiters.grant('k', 'a', waiter.waitId, 9);
    // An attempt refused at token 8 cannot have seen the grant of token 9: it stays.
    waiter.forgetGrant(8);
    expect(await settled(waiter.sleep(LONG))).toBe('granted');
    waiters.grant('k', 'a', waiter.waitId, 10);
    // Refused at token 10: the grant of 10 is void.
    waiter.forgetGrant(10);
    expect(await settled(waiter.sleep(LONG))).toBe(PENDING);
  });

  it("bounds a sleep's timer at Node's largest delay, so a wait with no end does not time out at once", () => {
    const delays: number[] = [];
    const time: Time = { ...realTime, setTimeout: (_callback, ms) => (delays.push(ms), { unref: () => undefined }), clearTimeout: () => undefined };
    waiters = new ReleaseWaiters(time);
    const waiter = join('a');
    void waiter.sleep(Number.MAX_SAFE_INTEGER);
    void waiter.sleep(-5);
    expect(delays).toEqual([2_147_483_647, 0]);
  });
});
