import type { Cluster, Redis } from 'ioredis';

/**
 * Commands written to one connection per socket write, at most: the rest of a turn's commands
 * follow in further writes. Redis starts on the first writes while Node is still producing the
 * next ones, so both processes work at once instead of taking turns on one large batch.
 */
export const COMMANDS_PER_WRITE = 8;

interface Corkable {
  cork(): void;
  uncork(): void;
}

/** Connections corked in this turn of the event loop, with how many commands wait in the current write. */
const corked = new WeakMap<Corkable, number>();

function uncorkAtEndOfTurn(stream: Corkable): void {
  corked.delete(stream);
  stream.uncork();
}

/**
 * Coalesces what nestjs-locked sends on `client`'s connection in one turn of the event loop into a
 * few socket writes (one per COMMANDS_PER_WRITE commands). Call it right before sending a command.
 *
 * ioredis writes each command to its socket as it is sent: a system call per command, and on the
 * other side a read (and a wake-up) per command. When many locks are taken or released at once
 * (concurrent requests, whose Redis replies arrive in one read), the socket is corked for the rest
 * of the turn and uncorked by `process.nextTick`, after the turn's promise callbacks have run, so
 * the commands they send leave in one `writev`. A lone command waits only for that turn's own
 * callbacks. Nothing is reordered (a corked socket keeps the order of every write, the
 * application's own commands on a shared client included) and nothing changes what Redis runs.
 *
 * A Cluster client (no single socket) and a client without a connection yet are left alone.
 */
export function batchWrites(client: Redis | Cluster): void {
  const stream = (client as Partial<Redis>).stream as Corkable | undefined;
  if (!stream || typeof stream.cork !== 'function') return;
  const waiting = corked.get(stream);
  if (waiting === undefined) {
    stream.cork();
    corked.set(stream, 1);
    process.nextTick(uncorkAtEndOfTurn, stream);
  } else if (waiting >= COMMANDS_PER_WRITE) {
    // This write is full: send it, and start the next one.
    stream.uncork();
    stream.cork();
    corked.set(stream, 1);
  } else {
    corked.set(stream, waiting + 1);
  }
}
