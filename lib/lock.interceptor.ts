import {
  HttpException,
  Injectable,
  type CallHandler,
  type ExecutionContext,
  type NestInterceptor,
} from '@nestjs/common';
import { catchError, from, isObservable, mergeMap, throwError, type Observable } from 'rxjs';
import { LockLostError } from './errors/lock-lost.error.js';
import { LockNotAcquiredError } from './errors/lock-not-acquired.error.js';
import { LOCKED_METADATA } from './lock.constants.js';
import { LockService } from './lock.service.js';

/**
 * Turns a lock failure of a `@Locked` handler into what its transport expects:
 *
 * - HTTP (Express, Fastify): `LockNotAcquiredError` becomes `409 Conflict` (or `423 Locked`, see
 *   `contendedHttpStatus`) with a `Retry-After` header (seconds until the holder's lease ends) and
 *   a JSON body naming the lock; `LockLostError` becomes `503 Service Unavailable`.
 * - Microservices: an `RpcException` with `{ status: 'error', code, message, key, retryAfterMs }`.
 * - WebSockets: a `WsException` with the same object.
 *
 * Every other error, the handler's own exceptions included, is returned unchanged.
 */
export async function translateLockError(error: unknown, context: ExecutionContext, contendedHttpStatus: number): Promise<unknown> {
  if (!(error instanceof LockNotAcquiredError) && !(error instanceof LockLostError)) return error;
  const contended = error instanceof LockNotAcquiredError;
  const retryAfterMs = contended ? error.retryAfterMs : undefined;
  const body = {
    code: contended ? 'LOCK_NOT_ACQUIRED' : 'LOCK_LOST',
    message: error.message,
    key: error.key,
    ...(retryAfterMs === undefined ? {} : { retryAfterMs }),
  };
  switch (context.getType<string>()) {
    case 'http': {
      const status = contended ? contendedHttpStatus : 503;
      if (contended) {
        const seconds = String(Math.max(1, Math.ceil((retryAfterMs ?? 1_000) / 1_000)));
        const response = context.switchToHttp().getResponse<{ header?: (n: string, v: string) => unknown; setHeader?: (n: string, v: string) => unknown }>();
        // Fastify's reply has header(); Express has both; a bare Node response only setHeader().
        if (typeof response.header === 'function') response.header('Retry-After', seconds);
        else response.setHeader?.('Retry-After', seconds);
      }
      const reason = status === 409 ? 'Conflict' : status === 423 ? 'Locked' : 'Service Unavailable';
      return new HttpException({ statusCode: status, error: reason, ...body }, status, { cause: error });
    }
    case 'rpc': {
      const { RpcException } = await import('@nestjs/microservices');
      return new RpcException({ status: 'error', ...body });
    }
    case 'ws': {
      const { WsException } = await import('@nestjs/websockets');
      return new WsException({ status: 'error', ...body });
    }
    default:
      return error;
  }
}

/** `result` (a Promise or an Observable) with its lock failures translated for `context`'s transport. */
export function withLockErrorsTranslated(result: unknown, context: ExecutionContext, contendedHttpStatus: number): unknown {
  const translate = (error: unknown) => translateLockError(error, context, contendedHttpStatus);
  if (isObservable(result)) {
    return result.pipe(catchError((error: unknown) => from(translate(error)).pipe(mergeMap((translated) => throwError(() => translated)))));
  }
  // A Promise may resolve to an Observable (a method that returns one without declaring it).
  return Promise.resolve(result).then(
    (value) => (isObservable(value) ? withLockErrorsTranslated(value, context, contendedHttpStatus) : value),
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
    return withLockErrorsTranslated(next.handle(), context, this.locks.settings.contendedHttpStatus) as Observable<unknown>;
  }
}
