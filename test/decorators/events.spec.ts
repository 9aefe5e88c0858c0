import { afterAll, beforeAll, describe, expect, it } from '@jest/globals';
import { Injectable, type INestApplicationContext } from '@nestjs/common';
import { EventEmitter2, EventEmitterModule, OnEvent } from '@nestjs/event-emitter';
import { Locked, LockNotAcquiredError, LockService } from '../../lib/index.js';
import { CapturingLogger, gate, nextEvent, oneAtATime, startInstance } from '../support/lock-testing.js';
import { RedisServer } from '../support/redis-server.js';

interface OrderEvent {
  id: number;
  /** Which emit this is, for the journal. */
  by: string;
}

/** What the listeners of all instances did, in order. */
const journal: string[] = [];
/** Emits whose listener waits, inside its lock, until the test opens the gate. */
const holds = new Map<string, ReturnType<typeof gate<void>>>();

@Injectable()
class OrderListeners {
  constructor(
    readonly events: EventEmitter2,
    readonly locks: LockService,
  ) {}

  // @Locked below @OnEvent
  @OnEvent('order.paid')
  @Locked('order:<0.id>')
  async paid(event: OrderEvent) {
    await this.work('paid', event);
  }

  // @Locked above @OnEvent
  @Locked('order:<0.id>')
  @OnEvent('order.shipped')
  async shipped(event: OrderEvent) {
    await this.work('shipped', event);
  }

  // A listener that emits another event whose listener locks the same key, and waits for it.
  @OnEvent('order.closed')
  @Locked('order:<0.id>')
  async closed(event: OrderEvent) {
    journal.push(`closed ${event.by} enter`);
    await this.events.emitAsync('order.audited', event);
    journal.push(`closed ${event.by} exit`);
  }

  @OnEvent('order.audited')
  @Locked('order:<0.id>', { waitMs: 2_000 })
  async audited(event: OrderEvent) {
    journal.push(`audited ${event.by} holds ${this.locks.current()?.key} x${await this.locks.holdCount(`order:${event.id}`)}`);
  }

  // Errors reach the emitter only with suppressErrors: false.
  @OnEvent('order.refunded', { suppressErrors: false })
  @Locked('order:<0.id>', { onContention: 'fail' })
  async refunded(event: OrderEvent) {
    journal.push(`refunded ${event.by}`);
  }

  @OnEvent('order.cancelled')
  @Locked('order:<0.id>', { onContention: 'fail' })
  async cancelled(event: OrderEvent) {
    journal.push(`cancelled ${event.by}`);
  }

  private async work(what: string, event: OrderEvent) {
    journal.push(`${what} ${event.by} enter`);
    await holds.get(event.by)?.promise;
    journal.push(`${what} ${event.by} exit`);
  }
}

describe('@Locked @OnEvent listeners of @nestjs/event-emitter', () => {
  let redis: RedisServer;
  let a: INestApplicationContext;
  let b: INestApplicationContext;
  // Nest's static Logger, which the emitter logs through, writes to the logger of the app created last: one for both.
  const logger = new CapturingLogger();
  beforeAll(async () => {
    redis = await RedisServer.start();
    const instance = { imports: [EventEmitterModule.forRoot()], providers: [OrderListeners] };
    a = await startInstance(redis.url, instance, logger);
    b = await startInstance(redis.url, instance, logger);
  });
  afterAll(async () => {
    await a?.close();
    await b?.close();
    await redis?.stop();
  });

  it.each([
    ['order.paid', 'below'],
    ['order.shipped', 'above'],
  ])('locks %s (@Locked %s @OnEvent) per key: events for one order run one at a time, in one instance and across two', async (name, _order) => {
    journal.length = 0;
    const [emitterA, emitterB] = [a.get(EventEmitter2), b.get(EventEmitter2)];
    const first = gate();
    holds.set('A1', first);
    const acquired = nextEvent(a.get(LockService).events$, 'acquired', (e) => e.key === 'order:1');
    const emits = [emitterA.emitAsync(name, { id: 1, by: 'A1' })];
    await acquired;
    // Two more events for the same order, one in each instance, find it locked and wait.
    const contendedA = nextEvent(a.get(LockService).events$, 'contended', (e) => e.key === 'order:1');
    const contendedB = nextEvent(b.get(LockService).events$, 'contended', (e) => e.key === 'order:1');
    emits.push(emitterA.emitAsync(name, { id: 1, by: 'A2' }), emitterB.emitAsync(name, { id: 1, by: 'B' }));
    await Promise.all([contendedA, contendedB]);
    // Another order is not held up by the first.
    await emitterB.emitAsync(name, { id: 2, by: 'B-other' });
    expect(journal.filter((e) => e.includes('B-other'))).toEqual([`${name.slice(6)} B-other enter`, `${name.slice(6)} B-other exit`]);
    expect(journal.filter((e) => !e.includes('B-other'))).toEqual([`${name.slice(6)} A1 enter`]);
    first.open();
    await Promise.all(emits);
    const order1 = journal.filter((e) => !e.includes('B-other'));
    expect(order1).toHaveLength(6);
    expect(oneAtATime(order1)).toBe(true);
    expect(await a.get(LockService).isLocked('order:1')).toBe(false);
  });

  it('re-enters, instead of deadlocking, when a locked listener emits an event whose listener locks the same key', async () => {
    journal.length = 0;
    await a.get(EventEmitter2).emitAsync('order.closed', { id: 3, by: 'A' });
    expect(journal).toEqual(['closed A enter', 'audited A holds order:3 x2', 'closed A exit']);
    expect(await a.get(LockService).isLocked('order:3')).toBe(false);
  });

  it('rejects emitAsync() with the LockNotAcquiredError with suppressErrors: false; by default the emitter logs it', async () => {
    journal.length = 0;
    const held = await b.get(LockService).acquire('order:4');
    try {
      const refused = await a
        .get(EventEmitter2)
        .emitAsync('order.refunded', { id: 4, by: 'A' })
        .then(
          () => undefined,
          (error: unknown) => error,
        );
      expect(refused).toBeInstanceOf(LockNotAcquiredError);
      expect((refused as LockNotAcquiredError).key).toBe('order:4');

      expect(await a.get(EventEmitter2).emitAsync('order.cancelled', { id: 4, by: 'A' })).toEqual([undefined]);
      expect(logger.at('error').some((m) => m.includes('"order:4" is held by another owner'))).toBe(true);
      expect(journal).toEqual([]);
    } finally {
      await held.release();
    }
    await a.get(EventEmitter2).emitAsync('order.cancelled', { id: 4, by: 'A' });
    expect(journal).toEqual(['cancelled A']);
  });
});
