import { afterAll, beforeAll, describe, expect, it } from '@jest/globals';
import { Injectable, Scope, type INestApplicationContext } from '@nestjs/common';
import { BullModule, getQueueToken, OnWorkerEvent, Processor, WorkerHost } from '@nestjs/bullmq';
import { QueueEvents, type Job, type Queue } from 'bullmq';
import { merge } from 'rxjs';
import { Locked, LockNotAcquiredError, LockService } from '../../lib/index.js';
import { gate, nextEvent, nextEvents, oneAtATime, startInstance } from '../support/lock-testing.js';
import { RedisServer } from '../support/redis-server.js';

interface Transfer {
  account: number;
  /** Which job this is, for the journal. */
  by: string;
}

/** What the processors of all instances did, in order. */
const journal: string[] = [];
/** Jobs whose processor waits, inside its lock, until the test opens the gate. */
const holds = new Map<string, ReturnType<typeof gate<void>>>();
/** Failed attempts seen by the fail-fast queue's worker event handler. */
const failures: { by: string; attempt: number; error: Error }[] = [];
let failed = gate<void>();

let madeForJobs = 0;
/** Made once per job: it makes PayoutProcessor request-scoped, so each job gets a new processor. */
@Injectable({ scope: Scope.REQUEST })
class PerJob {
  readonly id = ++madeForJobs;
}

/**
 * One instance of an app with two BullMQ processors: `ledger` waits for the lock (the module's
 * default), `audit` fails the attempt at once when the account is locked, and BullMQ retries it;
 * and, with `payout`, a request-scoped processor with two slots.
 */
async function startBullInstance(name: string, connection: { host: string; port: number }, concurrency: number, payout = false): Promise<INestApplicationContext> {
  @Processor('ledger', { concurrency })
  class LedgerProcessor extends WorkerHost {
    constructor(readonly locks: LockService) {
      super();
    }

    @Locked('account:<0.data.account>')
    async process(job: Job<Transfer>) {
      const { by } = job.data;
      journal.push(`${by} on ${name} enter x${await this.locks.holdCount(`account:${job.data.account}`)}`);
      await holds.get(by)?.promise;
      journal.push(`${by} on ${name} exit`);
      return `${by} done`;
    }
  }

  @Processor('audit')
  class AuditProcessor extends WorkerHost {
    @Locked('account:<0.data.account>', { onContention: 'fail' })
    async process(job: Job<Transfer>) {
      journal.push(`audit ${job.data.by} on ${name} attempt ${job.attemptsMade + 1}`);
      return 'audited';
    }

    @OnWorkerEvent('failed')
    onFailed(job: Job<Transfer>, error: Error) {
      failures.push({ by: job.data.by, attempt: job.attemptsMade, error });
      failed.open();
    }
  }

  @Processor('payout', { concurrency: 2 })
  class PayoutProcessor extends WorkerHost {
    constructor(
      private readonly per: PerJob,
      readonly locks: LockService,
    ) {
      super();
    }

    @Locked('account:<0.data.account>')
    async process(job: Job<Transfer>) {
      const { by } = job.data;
      journal.push(`${by} enter x${await this.locks.holdCount(`account:${job.data.account}`)}`);
      await holds.get(by)?.promise;
      journal.push(`${by} exit`);
      return this.per.id;
    }
  }

  return startInstance(`redis://${connection.host}:${connection.port}`, {
    imports: [BullModule.forRoot({ connection }), BullModule.registerQueue({ name: 'ledger' }, { name: 'audit' }, { name: 'payout' })],
    providers: [LedgerProcessor, AuditProcessor, ...(payout ? [PayoutProcessor, PerJob] : [])],
  });
}

describe('@Locked process() of @nestjs/bullmq processors', () => {
  let redis: RedisServer;
  let a: INestApplicationContext;
  let b: INestApplicationContext;
  const queueEvents: QueueEvents[] = [];
  beforeAll(async () => {
    redis = await RedisServer.start();
    const connection = { host: '127.0.0.1', port: redis.port };
    // Five job slots in all: while one job holds an account, three more for it take three of the
    // other four (at least one of them in the other instance), and one is left for another account.
    a = await startBullInstance('A', connection, 2, true);
    b = await startBullInstance('B', connection, 3);
    for (const name of ['ledger', 'audit', 'payout']) {
      const events = new QueueEvents(name, { connection });
      await events.waitUntilReady();
      queueEvents.push(events);
    }
  });
  afterAll(async () => {
    // A failed test may leave a job waiting at its gate, and closing waits for running jobs.
    for (const hold of holds.values()) hold.open();
    await a?.close();
    await b?.close();
    await Promise.all(queueEvents.map((e) => e.close()));
    await redis?.stop();
  });

  it('runs jobs for one account one at a time, across workers and instances, and does not hold up other accounts', async () => {
    journal.length = 0;
    const ledger = a.get<Queue<Transfer>>(getQueueToken('ledger'));
    const [ledgerEvents] = queueEvents;
    const events$ = merge(a.get(LockService).events$, b.get(LockService).events$);
    const first = gate();
    holds.set('J1', first);

    const acquired = nextEvent(events$, 'acquired', (e) => e.key === 'account:1');
    const jobs = [await ledger.add('transfer', { account: 1, by: 'J1' })];
    await acquired;
    // Three more jobs for the same account take free worker slots and find it locked.
    const contended = nextEvents(events$, 'contended', 3);
    for (const by of ['J2', 'J3', 'J4']) jobs.push(await ledger.add('transfer', { account: 1, by }));
    expect((await contended).map((e) => e.key)).toEqual(['account:1', 'account:1', 'account:1']);
    const waiting = await Promise.all(jobs.slice(1).map((job) => job.getState()));
    expect(waiting).toEqual(['active', 'active', 'active']);

    // Another account is not held up: its job runs while J1 holds account 1 and the rest wait.
    const other = await ledger.add('transfer', { account: 2, by: 'K1' });
    expect(await other.waitUntilFinished(ledgerEvents!)).toBe('K1 done');
    expect(journal.filter((e) => !e.startsWith('K1'))).toEqual([expect.stringMatching(/^J1 on [AB] enter x1$/)]);

    first.open();
    const results = await Promise.all(jobs.map((job) => job.waitUntilFinished(ledgerEvents!)));
    expect(results.sort()).toEqual(['J1 done', 'J2 done', 'J3 done', 'J4 done']);
    const account1 = journal.filter((e) => e.startsWith('J'));
    expect(account1).toHaveLength(8);
    // Each job ran alone, with a hold count of 1: no job re-entered the lock of another.
    expect(oneAtATime(account1, ' enter x1')).toBe(true);
    // Both instances ran jobs for the account.
    expect(new Set(account1.map((e) => e.split(' ')[2]))).toEqual(new Set(['A', 'B']));
    expect(await a.get(LockService).isLocked('account:1')).toBe(false);
  });

  it("fails the attempt with LockNotAcquiredError on contention with onContention: 'fail', and BullMQ's retry runs it once the lock is free", async () => {
    journal.length = 0;
    failures.length = 0;
    failed = gate();
    const audit = a.get<Queue<Transfer>>(getQueueToken('audit'));
    const held = await b.get(LockService).acquire('account:7');
    let job: Job<Transfer>;
    try {
      job = await audit.add('audit', { account: 7, by: 'R1' }, { attempts: 3, backoff: { type: 'fixed', delay: 100 } });
      await failed.promise;
      expect(failures).toHaveLength(1);
      expect(failures[0]!.by).toBe('R1');
      expect(failures[0]!.attempt).toBe(1);
      expect(failures[0]!.error).toBeInstanceOf(LockNotAcquiredError);
      expect((failures[0]!.error as LockNotAcquiredError).key).toBe('account:7');
      // It did not wait for the lock ('timeout' would mean it had).
      expect((failures[0]!.error as LockNotAcquiredError).reason).toBe('contended');
      // The attempt never entered the method.
      expect(journal).toEqual([]);
      expect(await a.get(LockService).isLocked('account:7')).toBe(true);
    } finally {
      await held.release();
    }
    expect(await job.waitUntilFinished(queueEvents[1]!)).toBe('audited');
    expect(journal).toEqual([expect.stringMatching(/^audit R1 on [AB] attempt 2$/)]);
    expect(failures).toHaveLength(1);
    const done = await audit.getJob(job.id!);
    expect(done?.attemptsMade).toBe(2);
    expect(done?.stacktrace?.join('\n')).toContain('LockNotAcquiredError');
  });

  it('locks request-scoped processors: each job gets its own processor, and two jobs for one account in one instance wait for each other', async () => {
    journal.length = 0;
    const payout = a.get<Queue<Transfer>>(getQueueToken('payout'));
    const first = gate();
    holds.set('P1', first);
    const acquired = nextEvent(a.get(LockService).events$, 'acquired', (e) => e.key === 'account:8');
    const jobs = [await payout.add('payout', { account: 8, by: 'P1' })];
    await acquired;
    const contended = nextEvent(a.get(LockService).events$, 'contended', (e) => e.key === 'account:8');
    jobs.push(await payout.add('payout', { account: 8, by: 'P2' }));
    await contended;
    // Both jobs are in the instance's two slots; the second waits for the first's lock.
    expect(await jobs[1]!.getState()).toBe('active');
    expect(journal).toEqual(['P1 enter x1']);
    first.open();
    const processors = await Promise.all(jobs.map((job) => job.waitUntilFinished(queueEvents[2]!)));
    expect(new Set(processors).size).toBe(2);
    expect(journal).toEqual(['P1 enter x1', 'P1 exit', 'P2 enter x1', 'P2 exit']);
    expect(await a.get(LockService).isLocked('account:8')).toBe(false);
  });
});
