import { afterAll, beforeAll, describe, expect, it } from '@jest/globals';
import { applyDecorators, Inject, Injectable, type INestApplicationContext } from '@nestjs/common';
import { Cron, Interval, ScheduleModule, Timeout } from '@nestjs/schedule';
import { setTimeout as sleep } from 'node:timers/promises';
import { Locked, LockService } from '../../lib/index.js';
import { nextEvent, startInstance } from '../support/lock-testing.js';
import { RedisServer } from '../support/redis-server.js';

interface Run {
  job: string;
  instance: string;
  at: number;
}

/** Everything the jobs of all instances did, and waiters for a number of runs. */
class Journal {
  readonly runs: Run[] = [];
  private readonly waiters: { job: string; count: number; resolve: () => void }[] = [];
  record(job: string, instance: string) {
    this.runs.push({ job, instance, at: Date.now() });
    for (const w of [...this.waiters]) {
      if (this.of(w.job).length >= w.count) {
        this.waiters.splice(this.waiters.indexOf(w), 1);
        w.resolve();
      }
    }
  }
  of(job: string) {
    return this.runs.filter((r) => r.job === job);
  }
  until(job: string, count: number): Promise<void> {
    if (this.of(job).length >= count) return Promise.resolve();
    return new Promise((resolve) => this.waiters.push({ job, count, resolve }));
  }
}
const journal = new Journal();
const INSTANCE = Symbol('instance');

/** The lock options of every job of CronJobs: the four differ only in how @Locked and @Cron are put together. */
const ONE_RUN_PER_TICK = { onContention: 'skip', minHoldMs: 500 } as const;

/**
 * A project's own decorator for a job that runs on one instance per tick, composed with
 * applyDecorators, which applies its decorators first to last: the later one is the outer.
 */
const OncePerTick = (key: string) => applyDecorators(Cron('* * * * * *'), Locked(key, ONE_RUN_PER_TICK));
const ScheduledLocked = (key: string) => applyDecorators(Locked(key, ONE_RUN_PER_TICK), Cron('* * * * * *'));

@Injectable()
class CronJobs {
  constructor(@Inject(INSTANCE) readonly instance: string) {}
  // @Locked below @Cron
  @Cron('* * * * * *')
  @Locked('cron:below', ONE_RUN_PER_TICK)
  async below() {
    journal.record('below', this.instance);
    await sleep(50);
  }

  // @Locked above @Cron
  @Locked('cron:above', ONE_RUN_PER_TICK)
  @Cron('* * * * * *')
  async above() {
    journal.record('above', this.instance);
    await sleep(50);
  }

  // Composed: @Locked the outer (as above @Cron), and the inner (as below it)
  @OncePerTick('cron:composed-above')
  async composedAbove() {
    journal.record('composedAbove', this.instance);
    await sleep(50);
  }

  @ScheduledLocked('cron:composed-below')
  async composedBelow() {
    journal.record('composedBelow', this.instance);
    await sleep(50);
  }
}

function startJobs(redisUrl: string, instance: string, providers: (new (...args: never[]) => object)[]): Promise<INestApplicationContext> {
  return startInstance(redisUrl, { imports: [ScheduleModule.forRoot()], providers: [{ provide: INSTANCE, useValue: instance }, ...providers] });
}

describe('@Locked scheduled jobs across two instances', () => {
  let redis: RedisServer;
  const apps: INestApplicationContext[] = [];
  beforeAll(async () => {
    redis = await RedisServer.start();
  });
  afterAll(async () => {
    await Promise.all(apps.map((a) => a.close()));
    await redis?.stop();
  });

  it('runs a @Cron job firing every second exactly once per tick across both instances, in both decorator orders, stacked or composed with applyDecorators', async () => {
    const jobs = ['below', 'above', 'composedAbove', 'composedBelow'];
    apps.push(await startJobs(redis.url, 'A', [CronJobs]), await startJobs(redis.url, 'B', [CronJobs]));
    await Promise.all(jobs.map((job) => journal.until(job, 6)));
    await Promise.all(apps.splice(0).map((a) => a.close()));
    for (const job of jobs) {
      const seconds = journal.of(job).map((r) => Math.floor(r.at / 1000));
      expect(new Set(seconds).size).toBe(seconds.length); // never twice in one tick
      const first = Math.min(...seconds);
      const last = Math.max(...seconds);
      expect(seconds.length).toBe(last - first + 1); // and no tick without a run
      expect(seconds.length).toBeGreaterThanOrEqual(6);
    }
  });
});

describe('@Locked with minHoldMs on a skewed second instance', () => {
  let redis: RedisServer;
  const apps: INestApplicationContext[] = [];
  beforeAll(async () => {
    redis = await RedisServer.start();
  });
  afterAll(async () => {
    await Promise.all(apps.map((a) => a.close()));
    await redis?.stop();
  });

  @Injectable()
  class IntervalJobs {
    constructor(@Inject(INSTANCE) readonly instance: string) {}
    @Interval(1_000)
    @Locked('interval:held', { onContention: 'skip', minHoldMs: 700 })
    async held() {
      journal.record('held', this.instance);
    }

    @Interval(1_000)
    @Locked('interval:bare', { onContention: 'skip' })
    async bare() {
      journal.record('bare', this.instance);
    }
  }

  it('does not re-run a tick on an instance whose trigger fires 300 ms late; without minHoldMs it does', async () => {
    apps.push(await startJobs(redis.url, 'A', [IntervalJobs]));
    await sleep(300); // the skew between the two instances' triggers: the scenario itself
    apps.push(await startJobs(redis.url, 'B', [IntervalJobs]));
    await journal.until('held', 4);
    await journal.until('bare', 8);
    await Promise.all(apps.splice(0).map((a) => a.close()));
    const held = journal.of('held');
    expect(held.every((r) => r.instance === 'A')).toBe(true);
    const bare = journal.of('bare');
    expect(bare.some((r) => r.instance === 'B')).toBe(true); // the late trigger ran the tick again
  });
});

describe('@Locked @Timeout jobs', () => {
  let redis: RedisServer;
  beforeAll(async () => {
    redis = await RedisServer.start();
  });
  afterAll(async () => {
    await redis?.stop();
  });

  @Injectable()
  class StartupJobs {
    constructor(@Inject(INSTANCE) readonly instance: string) {}
    @Locked('startup:migrate', { onContention: 'skip', minHoldMs: 2_000 })
    @Timeout(100)
    async migrate() {
      journal.record('migrate', this.instance);
    }
  }

  it('runs a one-off @Timeout job on one of two instances', async () => {
    const apps = await Promise.all([startJobs(redis.url, 'A', [StartupJobs]), startJobs(redis.url, 'B', [StartupJobs])]);
    // One instance runs the job; the other's trigger finds the lock held and skips.
    const skipped = Promise.race(apps.map((a) => nextEvent(a.get(LockService).events$, 'skipped', (e) => e.key === 'startup:migrate')));
    await Promise.all([journal.until('migrate', 1), skipped]);
    await Promise.all(apps.map((a) => a.close()));
    expect(journal.of('migrate')).toHaveLength(1);
  });
});
