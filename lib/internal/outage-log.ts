import { now } from './time.js';

/** How often, at most, one kind of failure is logged while it keeps happening. */
export const OUTAGE_LOG_INTERVAL_MS = 10_000;

/**
 * Logs one kind of failure that tends to come in floods (every request of an app whose Redis is
 * down fails the same way): the first one at once, then at most one line per `intervalMs`, each
 * saying how many it stands for; and, once things work again, one line counting the failures
 * that were not logged one by one. Internal.
 */
export class OutageLog {
  /** Failures since the last line. */
  private unlogged = 0;
  /** When the last line was written (monotonic ms); undefined while nothing fails. */
  private lastLine: number | undefined;

  constructor(
    /** Failures go to `error`, the recovery line to `log` (Nest's Logger). */
    private readonly logger: { error(message: string): void; log(message: string): void },
    /** What failed, for the lines: `@Locked calls were answered "unavailable"`. */
    private readonly what: string,
    /** What a success means, for the recovery line: `locks can be had again`. */
    private readonly working: string,
    private readonly intervalMs = OUTAGE_LOG_INTERVAL_MS,
    private readonly clock: () => number = now,
  ) {}

  /** Whether failures were seen since the last success (one property read: it runs on every grant). */
  get active(): boolean {
    return this.lastLine !== undefined;
  }

  failed(message: string): void {
    const at = this.clock();
    if (this.lastLine !== undefined && at - this.lastLine < this.intervalMs) {
      this.unlogged++;
      return;
    }
    const more = this.unlogged;
    this.unlogged = 0;
    this.lastLine = at;
    this.logger.error(more === 0 ? message : `${message} (and ${more} more ${this.what} since the previous line, not logged one by one)`);
  }

  /** It works again: say how many failures went unlogged, if any, and start over. */
  recovered(): void {
    if (this.lastLine === undefined) return;
    const more = this.unlogged;
    this.unlogged = 0;
    this.lastLine = undefined;
    if (more > 0) this.logger.log(`${this.working}; ${more} more ${this.what} after the last line about them`);
  }
}
