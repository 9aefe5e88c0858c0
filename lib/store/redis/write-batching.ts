import type { Cluster, Redis } from 'ioredis';
// Node's own, not the global: a test runner's fake timers (Jest's replace the global setImmediate)
// must not hold the lock's commands back.
import { setImmediate } from 'node:timers';

/**
 * Commands written to one connection per socket write, at most: the rest of a batch's commands
 * follow in further writes. Redis starts on the first writes while Node is still producing the
 * next ones, so both processes work at once instead of taking turns on one large batch.
 */
export const COMMANDS_PER_WRITE = 8;

interface Corkable {
  cork(): void;
  uncork(): void;
}

/** Connections corked until the next immediate, with how many commands wait in the current write. */
const corked = new WeakMap<Corkable, number>();

function uncorkAfterPoll(stream: Corkable): void {
  corked.delete(stream);
  stream.uncork();
}

/**
 * Coalesces what nestjs-locked sends on `client`'s connection in one pass of the event loop into a
 * few socket writes (one per COMMANDS_PER_WRITE commands). Call it right before sending a command.
 *
 * ioredis writes each command to its socket as it is sent: a system call per command, and on the
 * other side a read (and a wake-up) per command. When many locks are taken or released at once
 * (concurrent requests read in one poll of the event loop, or Redis replies that arrive in one
 * read), the socket is corked until `setImmediate`, which runs once the I/O callbacks of that poll
 * and their promise callbacks have sent their commands, so they leave in one `writev` per
 * COMMANDS_PER_WRITE. A command sent while the connection has nothing in flight and nothing corked
 * is written at once: it has no batch to join yet, and one caller at a time (a sequential loop, a
 * lone request) would otherwise wait for the immediate on every command (README, "Write
 * batching"). Commands sent after it find it in flight and are corked. Nothing is reordered (a
 * corked socket keeps the order of every write, the application's own commands on a shared
 * client included, and a command is written at once only when nothing is corked) and nothing
 * changes what Redis runs.
 *
 * `withNext`: the caller is about to send more commands in this pass (a release with the attempt of
 * the waiter it takes along), so the command is corked even when nothing is in flight: they leave
 * in one write, and Redis runs them one after the other.
 *
 * A Cluster client (no single socket) and a client without a connection yet are left alone.
 */
export function batchWrites(client: Redis | Cluster, withNext = false): void {
  const stream = (client as Partial<Redis>).stream as Corkable | undefined;
  if (!stream || typeof stream.cork !== 'function') return;
  const waiting = corked.get(stream);
  if (waiting === undefined) {
    // Nothing in flight and nothing corked: written at once (see above).
    if (!withNext && (client as Partial<Redis>).commandQueue?.length === 0) return;
    stream.cork();
    corked.set(stream, 1);
    setImmediate(uncorkAfterPoll, stream);
  } else if (waiting >= COMMANDS_PER_WRITE) {
    // This write is full: send it, and start the next one.
    stream.uncork();
    stream.cork();
    corked.set(stream, 1);
  } else {
    corked.set(stream, waiting + 1);
  }
}
