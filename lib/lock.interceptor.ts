import {
  HttpException,
  Injectable,
  type CallHandler,
  type ExecutionContext,
  type NestInterceptor,
} from '@nestjs/common';
import { catchError, from, mergeMap, throwError, type Observable } from 'rxjs';
import { LockLostError } from './errors/lock-lost.error.js';
import { LockNotAcquiredError } from './errors/lock-not-acquired.error.js';
import { LOCKED_METADATA } from './lock.constants.js';
import { LockService } from './lock.service.js';

/**
 * The transport side of `@Locked` controller handlers, applied by `@Locked` itself (and harmless
 * when registered globally: handlers without `@Locked` pass through untouched).
 *
 * The lock is taken by the `@Locked` method wrapper, because only there are the arguments known
 * after pipes, and that same wrapper serves scheduled jobs and direct calls where no interceptor
 * runs. This interceptor decides what a lock failure means to the caller:
 *
 * - HTTP (Express, Fastify): `LockNotAcquiredError` becomes `409 Conflict` (or `423 Locked`, see
 *   `contendedHttpStatus`) with a `Retry-After` header (seconds until the holder's lease ends) and
 *   a JSON body naming the lock; `LockLostError` becomes `503 Service Unavailable`.
 * - Microservices: an `RpcException` with `{ status: 'error', code, message, key, retryAfterMs }`.
 * - WebSockets: a `WsException` with the same object.
 *
 * Every other error, the handler's own exceptions included, passes through unchanged.
 */
@Injectable()
export class LockInterceptor implements NestInterceptor {
  constructor(private readonly locks: LockService) {}

  intercept(context: ExecutionContext, next: CallHandler): Observable<unknown> {
    if (!Reflect.getMetadata(LOCKED_METADATA, context.getHandler())) return next.handle();
    return next.handle().pipe(
      catchError((error: unknown) => {
        if (!(error instanceof LockNotAcquiredError) && !(error instanceof LockLostError)) return throwError(() => error);
        return from(this.translate(error, context)).pipe(mergeMap((translated) => throwError(() => translated)));
      }),
    );
  }

  private async translate(error: LockNotAcquiredError | LockLostError, context: ExecutionContext): Promise<unknown> {
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
        const status = contended ? this.locks.settings.contendedHttpStatus : 503;
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
}
