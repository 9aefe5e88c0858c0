import { createParamDecorator, type ExecutionContext } from '@nestjs/common';

/**
 * The call site of a `@Locked` handler called by Nest: an extra argument Nest fills in (a custom
 * parameter decorator) and `@Locked` removes before the method runs. It carries the execution
 * context, so lock failures are translated for the transport (HTTP status, `RpcException`,
 * `WsException`) without an interceptor around every call: Nest wraps a handler that has
 * interceptors in rxjs on every call, which costs more than the lock itself on a fast endpoint.
 */
export class LockCallSite {
  constructor(readonly context: ExecutionContext) {}
}

const callSite = createParamDecorator((_data: unknown, context: ExecutionContext) => new LockCallSite(context));

/** Where Nest keeps a handler's parameter decorators (`ROUTE_ARGS_METADATA` of `@nestjs/common/constants`). */
const ROUTE_ARGS_METADATA = '__routeArguments__';

/**
 * Declares the call-site argument on a method at decoration time and returns its index, or
 * `undefined` where it would change what the method receives, so `LockInterceptor` must do the
 * work instead. Nest passes a handler only the arguments its parameter decorators declare, once it
 * has any: for HTTP always, but a microservice or WebSocket handler without parameter decorators
 * receives the raw (data, context) or (client, data) arguments, which one more declared parameter
 * would take away. So the argument is added when the method already has parameter decorators, or
 * when it is known to be an HTTP route (`@Locked` above `@Get` and the like); it goes after every
 * declared parameter.
 */
export function declareCallSite(target: object, key: string | symbol, method: (...args: unknown[]) => unknown): number | undefined {
  const declared = Reflect.getMetadata(ROUTE_ARGS_METADATA, target.constructor, key) as Record<string, { index: number }> | undefined;
  const indexes = Object.values(declared ?? {}).map((a) => a.index);
  const httpRoute = Reflect.hasOwnMetadata('path', method) && Reflect.hasOwnMetadata('method', method);
  if (indexes.length === 0 && !httpRoute) return undefined;
  const paramtypes = Reflect.getMetadata('design:paramtypes', target, key) as unknown[] | undefined;
  const index = Math.max(paramtypes?.length ?? 0, method.length, ...indexes.map((i) => i + 1));
  callSite()(target, key, index);
  return index;
}
