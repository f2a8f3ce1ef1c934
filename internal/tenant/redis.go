package tenant

import (
	"context"
	"fmt"
	"log/slog"
	"strconv"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/baton-llm/baton/internal/config"
)

// redisStore keeps rules' counts in Redis, shared by every replica: one script call per
// reservation and one per settlement (EVALSHA), each atomic on the server, with the server's
// clock. A rule's keys share a hash tag ({id}), so that a Redis Cluster keeps them on one node.
type redisStore struct {
	c *redis.Client
}

// reserveScript: KEYS request bucket, token bucket, requests at once; ARGV period (µs), rpm,
// tpm, max at once, tokens, reservation id, hold (µs). Refuses changing nothing, or takes the
// request from every limit. Returns reason ("" when admitted), retry-after (µs), the buckets
// and the requests at once after it, and the server's time (µs).
var reserveScript = redis.NewScript(`
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
local period, rpm, tpm, cmax = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4])
local cost, id, hold = tonumber(ARGV[5]), ARGV[6], tonumber(ARGV[7])
local function tat(key)
  local v = redis.call('GET', key)
  if v then
    v = tonumber(v)
    if v > now then return v end
  end
  return now
end
local reason, over, inflight = '', 0, 0
local rt, tt = now, now
if cmax > 0 then
  redis.call('ZREMRANGEBYSCORE', KEYS[3], '-inf', now)
  inflight = redis.call('ZCARD', KEYS[3])
  if inflight >= cmax then reason, over = 'concurrency', 1000000 end
end
local rnext, tnext = now, now
if rpm > 0 then
  rt = tat(KEYS[1])
  local per = period / rpm
  rnext = rt + per
  local o = rt - now + per - period
  if reason == '' and o > 0 then reason, over = 'requests', o end
end
if tpm > 0 then
  tt = tat(KEYS[2])
  local per = period / tpm
  tnext = tt + cost * per
  local o = tt - now + math.min(cost, tpm) * per - period
  if reason == '' and o > 0 then reason, over = 'tokens', o end
end
if reason == '' then
  if rpm > 0 then
    rt = rnext
    redis.call('SET', KEYS[1], string.format('%.0f', rt), 'PX', math.ceil((rt - now) / 1000) + 1000)
  end
  if tpm > 0 then
    tt = tnext
    redis.call('SET', KEYS[2], string.format('%.0f', tt), 'PX', math.ceil((tt - now) / 1000) + 1000)
  end
  if cmax > 0 then
    redis.call('ZADD', KEYS[3], now + hold, id)
    redis.call('PEXPIRE', KEYS[3], math.ceil(hold / 1000) + 1000)
    inflight = inflight + 1
  end
end
return {reason, string.format('%.0f', over), string.format('%.0f', rt), string.format('%.0f', tt), inflight, string.format('%.0f', now)}
`)

// settleScript: KEYS token bucket, requests at once; ARGV period (µs), tpm, delta tokens,
// reservation id. Moves the token bucket by delta (never below full) and frees the slot.
var settleScript = redis.NewScript(`
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
local period, tpm, delta, id = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3]), ARGV[4]
if tpm > 0 and delta ~= 0 then
  local v = redis.call('GET', KEYS[1])
  local tat = now
  if v and tonumber(v) > now then tat = tonumber(v) end
  tat = tat + delta * period / tpm
  if tat > now then
    redis.call('SET', KEYS[1], string.format('%.0f', tat), 'PX', math.ceil((tat - now) / 1000) + 1000)
  else
    redis.call('DEL', KEYS[1])
  end
end
if id ~= '' then redis.call('ZREM', KEYS[2], id) end
return 1
`)

// cancelScript: KEYS request bucket, token bucket, requests at once; ARGV period (µs), rpm, tpm,
// tokens, reservation id. Undoes one reservation: each bucket moved back by what it took (a
// bucket back at full is deleted), the slot freed.
var cancelScript = redis.NewScript(`
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
local period, rpm, tpm, cost, id = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4]), ARGV[5]
local function back(key, by)
  local v = redis.call('GET', key)
  if not v then return end
  local tat = tonumber(v) - by
  if tat > now then
    redis.call('SET', key, string.format('%.0f', tat), 'PX', math.ceil((tat - now) / 1000) + 1000)
  else
    redis.call('DEL', key)
  end
end
if rpm > 0 then back(KEYS[1], period / rpm) end
if tpm > 0 then back(KEYS[2], cost * period / tpm) end
if id ~= '' then redis.call('ZREM', KEYS[3], id) end
return 1
`)

// peekScript: KEYS request bucket, token bucket, requests at once. Returns them and the time.
var peekScript = redis.NewScript(`
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
local ts = string.format('%.0f', now) -- tostring would keep 14 digits: tens of µs off
local r = redis.call('GET', KEYS[1]) or ts
local k = redis.call('GET', KEYS[2]) or ts
local n = redis.call('ZCOUNT', KEYS[3], '(' .. string.format('%.0f', now), '+inf')
return {r, k, n, string.format('%.0f', now)}
`)

// RedisOptions parses a store URL: redis://[:PASSWORD@]HOST:PORT/DB, rediss:// for TLS;
// password, when the URL has none, from REDIS_PASSWORD (getenv).
func RedisOptions(raw string, getenv func(string) string) (*redis.Options, error) {
	o, err := redis.ParseURL(raw)
	if err != nil {
		return nil, fmt.Errorf("rate_limit_store %s: %v", config.RedactURL(raw), err)
	}
	if o.Password == "" {
		o.Password = getenv("REDIS_PASSWORD")
	}
	return o, nil
}

// redisLog routes the Redis client's own messages (a pool that cannot dial, …) to Baton's log at
// debug level: the limiter reports the store's state itself, once a minute.
type redisLog struct{ log *slog.Logger }

func (r redisLog) Printf(ctx context.Context, format string, v ...any) {
	if r.log != nil {
		r.log.Debug("rate limit store: " + fmt.Sprintf(format, v...))
	}
}

// UseRedis makes l count in the Redis o names, shared by every replica using it. Each call has
// l's timeout; the client's own retries are off (a failed call falls back at once).
func (l *Limiter) UseRedis(o *redis.Options) {
	o.MaxRetries = -1
	o.DialTimeout, o.ReadTimeout, o.WriteTimeout = l.Timeout, l.Timeout, l.Timeout
	o.ContextTimeoutEnabled = true
	if o.PoolSize == 0 {
		// A reservation waits for a connection otherwise: a request's calls are short, but a
		// busy replica makes hundreds at once.
		o.PoolSize, o.MinIdleConns = 256, 16
	}
	redis.SetLogger(redisLog{l.Log})
	l.shared = &redisStore{c: redis.NewClient(o)}
}

// Close closes the shared store's connections.
func (l *Limiter) Close() error {
	if rs, ok := l.shared.(*redisStore); ok {
		return rs.c.Close()
	}
	return nil
}

func keys(r *Rule) []string {
	tag := "baton:rl:{" + r.ID + "}:"
	return []string{tag + "req", tag + "tok", tag + "conc"}
}

func (s *redisStore) reserve(ctx context.Context, r *Rule, id string, tokens int, hold time.Duration) (string, time.Duration, state, float64, error) {
	v, err := reserveScript.Run(ctx, s.c, keys(r), period.Microseconds(), r.RPM, r.TPM, r.Concurrent, tokens, id, hold.Microseconds()).Slice()
	if err != nil {
		return "", 0, state{}, 0, err
	}
	if len(v) != 6 {
		return "", 0, state{}, 0, fmt.Errorf("rate limit store: the reserve script answered %d values", len(v))
	}
	reason, _ := v[0].(string)
	over, now := num(v[1]), num(v[5])
	st := state{reqTAT: num(v[2]), tokTAT: num(v[3])}
	if n, ok := v[4].(int64); ok {
		st.inflight = int(n)
	}
	return reason, time.Duration(over) * time.Microsecond, st, now, nil
}

func (s *redisStore) settle(ctx context.Context, r *Rule, id string, delta int) error {
	k := keys(r)
	if r.Concurrent <= 0 {
		id = ""
	}
	return settleScript.Run(ctx, s.c, []string{k[1], k[2]}, period.Microseconds(), r.TPM, delta, id).Err()
}

func (s *redisStore) cancel(ctx context.Context, r *Rule, id string, tokens int) error {
	if r.Concurrent <= 0 {
		id = ""
	}
	return cancelScript.Run(ctx, s.c, keys(r), period.Microseconds(), r.RPM, r.TPM, tokens, id).Err()
}

func (s *redisStore) peek(ctx context.Context, r *Rule) (state, float64, error) {
	v, err := peekScript.Run(ctx, s.c, keys(r)).Slice()
	if err != nil {
		return state{}, 0, err
	}
	if len(v) != 4 {
		return state{}, 0, fmt.Errorf("rate limit store: the peek script answered %d values", len(v))
	}
	st := state{reqTAT: num(v[0]), tokTAT: num(v[1])}
	if n, ok := v[2].(int64); ok {
		st.inflight = int(n)
	}
	return st, num(v[3]), nil
}

func num(v any) float64 {
	switch x := v.(type) {
	case string:
		f, _ := strconv.ParseFloat(x, 64)
		return f
	case int64:
		return float64(x)
	}
	return 0
}
