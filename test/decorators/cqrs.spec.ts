import { afterAll, beforeAll, describe, expect, it } from '@jest/globals';
import { Injectable, Scope, type INestApplicationContext } from '@nestjs/common';
import {
  CommandBus,
  CommandHandler,
  CqrsModule,
  EventBus,
  EventsHandler,
  ofType,
  Saga,
  UnhandledExceptionBus,
  type ICommandHandler,
  type IEvent,
  type IEventHandler,
} from '@nestjs/cqrs';
import { firstValueFrom, map, type Observable } from 'rxjs';
import { Locked, LockNotAcquiredError, LockService } from '../../lib/index.js';
import { CapturingLogger, gate, nextEvent, oneAtATime, startInstance } from '../support/lock-testing.js';
import { RedisServer } from '../support/redis-server.js';

class Deposit {
  constructor(
    readonly account: number,
    /** Which command this is, for the journal. */
    readonly by: string,
  ) {}
}

class Close {
  constructor(readonly account: number) {}
}

class Closed {
  constructor(readonly account: number) {}
}

class Audit {
  constructor(readonly account: number) {}
}

class Audited {
  constructor(readonly account: number) {}
}

/** What the handlers of all instances did, in order. */
const journal: string[] = [];
/** Commands whose handler waits, inside its lock, until the test opens the gate. */
const holds = new Map<string, ReturnType<typeof gate<void>>>();
/** Steps of the Close / Closed pair the test waits for or lets go on. */
let closeSteps = steps();

function steps() {
  return { published: gate(), closedEntered: gate(), closeMayReturn: gate(), closedMayReturn: gate() };
}

@CommandHandler(Deposit)
class DepositHandler implements ICommandHandler<Deposit> {
  constructor(private readonly locks: LockService) {}

  @Locked('account:<0.account>')
  async execute(command: Deposit) {
    journal.push(`${command.by} enter x${await this.locks.holdCount(`account:${command.account}`)}`);
    await holds.get(command.by)?.promise;
    journal.push(`${command.by} exit`);
    return command.by;
  }
}

// A locked command that executes another command for the same account through the bus.
@CommandHandler(Close)
class CloseHandler implements ICommandHandler<Close> {
  constructor(
    private readonly commands: CommandBus,
    private readonly events: EventBus,
  ) {}

  @Locked('account:<0.account>')
  async execute(command: Close) {
    const last = await this.commands.execute(new Deposit(command.account, 'final deposit'));
    // Publishing does not wait for the event's handlers.
    this.events.publish(new Closed(command.account));
    closeSteps.published.open();
    await closeSteps.closeMayReturn.promise;
    journal.push('close exit');
    return last;
  }
}

@EventsHandler(Closed)
class ClosedHandler implements IEventHandler<Closed> {
  constructor(private readonly locks: LockService) {}

  @Locked('account:<0.account>')
  async handle(event: Closed) {
    journal.push(`closed enter x${await this.locks.holdCount(`account:${event.account}`)}`);
    closeSteps.closedEntered.open();
    await closeSteps.closedMayReturn.promise;
    journal.push('closed exit');
  }
}

class Pay {
  constructor(
    readonly account: number,
    readonly by: string,
  ) {}
}

let made = 0;
/** Made once per command: it makes PayHandler request-scoped, so each command gets a new handler. */
@Injectable({ scope: Scope.REQUEST })
class PerCommand {
  readonly id = ++made;
}

@CommandHandler(Pay)
class PayHandler implements ICommandHandler<Pay> {
  constructor(
    private readonly per: PerCommand,
    private readonly locks: LockService,
  ) {}

  @Locked('account:<0.account>')
  async execute(command: Pay) {
    journal.push(`${command.by} enter x${await this.locks.holdCount(`account:${command.account}`)}`);
    await holds.get(command.by)?.promise;
    journal.push(`${command.by} exit`);
    return this.per.id;
  }
}

class Withdraw {
  constructor(readonly account: number) {}
}

@CommandHandler(Withdraw)
class WithdrawHandler implements ICommandHandler<Withdraw> {
  @Locked('account:<0.account>', { onContention: 'fail' })
  async execute(command: Withdraw) {
    journal.push(`withdraw ${command.account}`);
  }
}

@CommandHandler(Audit)
class AuditHandler implements ICommandHandler<Audit> {
  constructor(private readonly events: EventBus) {}

  async execute(command: Audit) {
    this.events.publish(new Audited(command.account));
  }
}

@EventsHandler(Audited)
class AuditedHandler implements IEventHandler<Audited> {
  @Locked('account:<0.account>', { onContention: 'fail' })
  async handle(event: Audited) {
    journal.push(`audited ${event.account}`);
  }
}

class Open {
  constructor(readonly account: number) {}
}

class Opened {
  constructor(readonly account: number) {}
}

class Welcome {
  constructor(readonly account: number) {}
}

/** Opened when the saga's command has run. */
let welcomed = gate();

// A locked command whose event a saga turns into another command for the same account, which it
// waits for while it holds the lock.
@CommandHandler(Open)
class OpenHandler implements ICommandHandler<Open> {
  constructor(private readonly events: EventBus) {}

  @Locked('account:<0.account>')
  async execute(command: Open) {
    this.events.publish(new Opened(command.account));
    await welcomed.promise;
    journal.push('open exit');
  }
}

@Injectable()
class AccountSagas {
  @Saga()
  opened = (events$: Observable<IEvent>) => events$.pipe(ofType(Opened), map((event) => new Welcome(event.account)));
}

@CommandHandler(Welcome)
class WelcomeHandler implements ICommandHandler<Welcome> {
  constructor(private readonly locks: LockService) {}

  @Locked('account:<0.account>')
  async execute(command: Welcome) {
    journal.push(`welcome enter x${await this.locks.holdCount(`account:${command.account}`)}`);
    welcomed.open();
  }
}

describe('@Locked command and event handlers of @nestjs/cqrs', () => {
  let redis: RedisServer;
  let a: INestApplicationContext;
  let b: INestApplicationContext;
  // Nest's static Logger, which @nestjs/cqrs logs through, writes to the logger of the app created last: one for both.
  const logger = new CapturingLogger();
  beforeAll(async () => {
    redis = await RedisServer.start();
    const instance = {
      imports: [CqrsModule.forRoot()],
      providers: [DepositHandler, CloseHandler, ClosedHandler, WithdrawHandler, AuditHandler, AuditedHandler, PayHandler, PerCommand, OpenHandler, AccountSagas, WelcomeHandler],
    };
    a = await startInstance(redis.url, instance, logger);
    b = await startInstance(redis.url, instance, logger);
  });
  afterAll(async () => {
    // A failed test may leave a handler waiting at its gate.
    for (const hold of holds.values()) hold.open();
    for (const step of Object.values(closeSteps)) step.open();
    welcomed.open();
    await a?.close();
    await b?.close();
    await redis?.stop();
  });

  it('runs commands for one account one at a time, in one instance and across two, and does not hold up other accounts', async () => {
    journal.length = 0;
    const [busA, busB] = [a.get(CommandBus), b.get(CommandBus)];
    const first = gate();
    holds.set('A1', first);
    const acquired = nextEvent(a.get(LockService).events$, 'acquired', (e) => e.key === 'account:1');
    const commands = [busA.execute(new Deposit(1, 'A1'))];
    await acquired;
    const contendedA = nextEvent(a.get(LockService).events$, 'contended', (e) => e.key === 'account:1');
    const contendedB = nextEvent(b.get(LockService).events$, 'contended', (e) => e.key === 'account:1');
    commands.push(busA.execute(new Deposit(1, 'A2')), busB.execute(new Deposit(1, 'B')));
    await Promise.all([contendedA, contendedB]);
    // Another account is not held up.
    expect(await busB.execute(new Deposit(2, 'other'))).toBe('other');
    expect(journal).toEqual(['A1 enter x1', 'other enter x1', 'other exit']);
    first.open();
    expect(await Promise.all(commands)).toEqual(['A1', 'A2', 'B']);
    const account1 = journal.filter((e) => !e.startsWith('other'));
    expect(account1).toHaveLength(6);
    expect(oneAtATime(account1, ' enter x1')).toBe(true);
    expect(await a.get(LockService).isLocked('account:1')).toBe(false);
  });

  it('locks request-scoped command handlers: each command gets its own handler, and two commands for one account wait for each other', async () => {
    journal.length = 0;
    const bus = a.get(CommandBus);
    const first = gate();
    holds.set('P1', first);
    const acquired = nextEvent(a.get(LockService).events$, 'acquired', (e) => e.key === 'account:5');
    const paid = [bus.execute(new Pay(5, 'P1'))];
    await acquired;
    const contended = nextEvent(a.get(LockService).events$, 'contended', (e) => e.key === 'account:5');
    paid.push(bus.execute(new Pay(5, 'P2')));
    await contended;
    expect(journal).toEqual(['P1 enter x1']);
    first.open();
    const handlers = await Promise.all(paid);
    expect(new Set(handlers).size).toBe(2);
    expect(oneAtATime(journal, ' enter x1')).toBe(true);
    expect(journal).toHaveLength(4);
  });

  it("re-enters from a command the handler executes, and from an event it publishes, whose handler keeps the lock after the command returns", async () => {
    journal.length = 0;
    closeSteps = steps();
    const close = a.get(CommandBus).execute(new Close(3));
    await closeSteps.published.promise;
    // The command executed through the bus re-entered the lock instead of waiting for itself.
    expect(journal).toEqual(['final deposit enter x2', 'final deposit exit']);
    // The event's handler started inside the command's lock, so it re-entered it too.
    await closeSteps.closedEntered.promise;
    expect(journal.at(-1)).toBe('closed enter x2');

    const commandReleased = nextEvent(a.get(LockService).events$, 'released', (e) => e.key === 'account:3');
    closeSteps.closeMayReturn.open();
    expect(await close).toBe('final deposit');
    expect((await commandReleased).holdCount).toBe(1);
    // The command returned; its event's handler still holds the lock, and another instance finds it held.
    expect(journal).not.toContain('closed exit');
    expect(await b.get(LockService).isLocked('account:3')).toBe(true);
    expect(await b.get(LockService).tryAcquire('account:3')).toBeNull();

    const released = nextEvent(a.get(LockService).events$, 'released', (e) => e.key === 'account:3');
    closeSteps.closedMayReturn.open();
    expect((await released).holdCount).toBe(0);
    expect(journal.at(-1)).toBe('closed exit');
    expect(await b.get(LockService).isLocked('account:3')).toBe(false);
  });

  it('re-enters from a command a saga makes of an event published inside a locked handler (the saga runs in the publisher\'s context)', async () => {
    journal.length = 0;
    welcomed = gate();
    const contended: unknown[] = [];
    const subscription = a.get(LockService).events$.subscribe((e) => e.type === 'contended' && contended.push(e));
    try {
      // Waiting for the saga's command instead of re-entering, this would wait out its 10 s and fail.
      await a.get(CommandBus).execute(new Open(6));
    } finally {
      subscription.unsubscribe();
    }
    expect(journal).toEqual(['welcome enter x2', 'open exit']);
    expect(contended).toEqual([]);
    expect(await b.get(LockService).isLocked('account:6')).toBe(false);
  });

  it("rejects commandBus.execute() with a command handler's LockNotAcquiredError; publishes an event handler's on the UnhandledExceptionBus, with the event as its cause, and logs it", async () => {
    journal.length = 0;
    const held = await b.get(LockService).acquire('account:4');
    try {
      const refused = await a
        .get(CommandBus)
        .execute(new Withdraw(4))
        .then(
          () => undefined,
          (error: unknown) => error,
        );
      expect(refused).toBeInstanceOf(LockNotAcquiredError);
      expect((refused as LockNotAcquiredError).key).toBe('account:4');

      const unhandled = firstValueFrom(a.get(UnhandledExceptionBus));
      await a.get(CommandBus).execute(new Audit(4));
      const { cause, exception } = await unhandled;
      expect(cause).toEqual(new Audited(4));
      expect(exception).toBeInstanceOf(LockNotAcquiredError);
      expect((exception as LockNotAcquiredError).key).toBe('account:4');
      expect((exception as LockNotAcquiredError).reason).toBe('contended');
      expect(logger.at('error').some((m) => m.includes('has thrown an unhandled exception'))).toBe(true);
      expect(journal).toEqual([]);
    } finally {
      await held.release();
    }
    await a.get(CommandBus).execute(new Withdraw(4));
    expect(journal).toEqual(['withdraw 4']);
  });
});
