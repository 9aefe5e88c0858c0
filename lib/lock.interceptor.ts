import {
  HttpException,
  Injectable,
  IntrinsicException,
  type CallHandler,
  type ExecutionContext,
  type NestInterceptor,
} from '@nestjs/common';
import { catchError, from, isObservable, mergeMap, throwError, type Observable } from 'rxjs';
import { LockBackendError } from './errors/lock-backend.error.js';
import { LockLostError } from './errors/lock-lost.error.js';
import { LockNotAcquiredError } from './errors/lock-not-acquired.error.js';
import { LockQuorumError } from './errors/lock-quorum.error.js';
import { LockReplicationError } from './errors/lock-replication.error.js';
import { LOCKED_METADATA } from './lock.constants.js';
import { LockService } from './lock.service.js';

/** What a transport is told about a lock failure: the error code, and the HTTP status. */
function classify(error: unknown, contendedHttpStatus: number): { code: string; status: number; unavailable: boolean } | undefined {
  if (error instanceof LockNotAcquiredError) return { code: 'LOCK_NOT_ACQUIRED', status: contendedHttpStatus, unavailable: false };
  if (error instanceof LockLostError) return { code: 'LOCK_LOST', status: 503, unavailable: false };
  if (error instanceof LockBackendError || error instanceof LockReplicationError || error instanceof LockQuorumError) {
    return { code: 'LOCK_UNAVAILABLE', status: 503, unavailable: true };
  }
  return undefined;
}

const REASONS: Record<number, string> = { 409: 'Conflict', 423: 'Locked', 503: 'Service Unavailable' };

/** What a GraphQL client reads in `errors[].extensions` of a `@Locked` resolver's lock failure. */
export interface LockErrorExtensions {
  code: 'LOCK_NOT_ACQUIRED' | 'LOCK_LOST' | 'LOCK_UNAVAILABLE';
  key?: string;
  retryAfterMs?: number;
}

/**
 * A lock failure of a `@Locked` GraphQL resolver. graphql-js answers every error a resolver throws
 * with a `GraphQLError` that copies the thrown error's `extensions`, so clients read the code in
 * `errors[].extensions.code` (no dependency on the `graphql` package needed). It is an
 * `IntrinsicException`, like `HttpException`, so Nest does not log it as an unhandled error; the
 * lock error is its `cause`.
 */
export class LockGraphQLError extends IntrinsicException {
  override readonly name = 'LockGraphQLError';
  constructor(
    message: string,
    readonly extensions: LockErrorExtensions,
    options: { cause: unknown },
  ) {
    super(message, options);
  }
}

/**
 * Turns a lock failure of a `@Locked` handler into what its transport expects:
 *
 * - HTTP (Express, Fastify): `LockNotAcquiredError` becomes `409 Conflict` (or `423 Locked`, see
 *   `contendedHttpStatus`) with a `Retry-After` header (seconds until the holder's lease ends) and
 *   a JSON body naming the lock; `LockLostError` becomes `503 Service Unavailable`; so does a lock
 *   that could not be had for want of Redis (`LockBackendError`, `LockReplicationError`,
 *   `LockQuorumError`: code `LOCK_UNAVAILABLE`), whose body says only that (the cause, which may
 *   name servers, goes to the log, since Nest does not log the exceptions it answers with).
 * - Microservices: an `RpcException` with `{ status: 'error', code, message, key, retryAfterMs }`.
 * - WebSockets: a `WsException` with the same object.
 * - GraphQL (`@nestjs/graphql` resolvers): a `LockGraphQLError` whose message is the body's and
 *   whose `extensions` are `{ code, key, retryAfterMs }`, which the GraphQL response carries.
 *
 * Every other error, the handler's own exceptions included, is returned unchanged.
 */
export async function translateLockError(error: unknown, context: ExecutionContext, locks: LockService): Promise<unknown> {
  const kind = classify(error, locks.settings.contendedHttpStatus);
  if (!kind) return error;
  const lockError = error as LockNotAcquiredError | LockLostError | LockBackendError | LockReplicationError | LockQuorumError;
  const type = context.getType<string>();
  if (type !== 'http' && type !== 'rpc' && type !== 'ws' && type !== 'graphql') return error;
  const retryAfterMs = lockError instanceof LockNotAcquiredError ? lockError.retryAfterMs : undefined;
  if (kind.unavailable) locks.noteUnavailable(lockError);
  const body = {
    code: kind.code,
    message: kind.unavailable
      ? `Lock${lockError.key === undefined ? '' : ` "${lockError.key}"`} is unavailable right now: its Redis store failed or did not answer, or the application is shutting down. Retry later.`
      : lockError.message,
    ...(lockError.key === undefined ? {} : { key: lockError.key }),
    ...(retryAfterMs === undefined ? {} : { retryAfterMs }),
  };
  switch (type) {
    case 'http': {
      const { status } = kind;
      if (lockError instanceof LockNotAcquiredError) {
        const seconds = String(Math.max(1, Math.ceil((retryAfterMs ?? 1_000) / 1_000)));
        const response = context.switchToHttp().getResponse<{ header?: (n: string, v: string) => unknown; setHeader?: (n: string, v: string) => unknown }>();
        // Fastify's reply has header(); Express has both; a bare Node response only setHeader().
        if (typeof response.header === 'function') response.header('Retry-After', seconds);
        else response.setHeader?.('Retry-After', seconds);
      }
      return new HttpException({ statusCode: status, error: REASONS[status], ...body }, status, { cause: error });
    }
    case 'rpc': {
      const { RpcException } = await import('@nestjs/microservices');
      return new RpcException({ status: 'error', ...body });
    }
    case 'graphql': {
      const { message, ...extensions } = body;
      return new LockGraphQLError(message, extensions as LockErrorExtensions, { cause: error });
    }
    default: {
      const { WsException } = await import('@nestjs/websockets');
      return new WsException({ status: 'error', ...body });
    }
  }
}

/** `result` (a Promise or an Observable) with its lock failures translated for `context`'s transport. */
export function withLockErrorsTranslated(result: unknown, context: ExecutionContext, locks: LockService): unknown {
  const translate = (error: unknown) => translateLockError(error, context, locks);
  if (isObservable(result)) {
    return result.pipe(catchError((error: unknown) => from(translate(error)).pipe(mergeMap((translated) => throwError(() => translated)))));
  }
  // A Promise may resolve to an Observable (a method that returns one without declaring it).
  return Promise.resolve(result).then(
    (value) => (isObservable(value) ? withLockErrorsTranslated(value, context, locks) : value),
    async (error: unknown) => {
      throw await translate(error);
    },
  );
}

/**
 * The transport side of `@Locked` handlers as a Nest interceptor (see `translateLockError`). `@Locked`
 * applies it itself only to handlers where it cannot receive its call site as an extra argument
 * (see the README); registered globally, it leaves handlers without `@Locked` untouched.
 */
@Injectable()
export class LockInterceptor implements NestInterceptor {
  constructor(private readonly locks: LockService) {}

  intercept(context: ExecutionContext, next: CallHandler): Observable<unknown> {
    if (!Reflect.getMetadata(LOCKED_METADATA, context.getHandler())) return next.handle();
    return withLockErrorsTranslated(next.handle(), context, this.locks) as Observable<unknown>;
  }
}
