package app

import (
	"log/slog"
	"os"
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/baton-llm/baton/internal/config"
	"github.com/baton-llm/baton/internal/metrics"
	"github.com/baton-llm/baton/internal/server"
	"github.com/baton-llm/baton/internal/tenant"
)

// tenancy is the gateway's tenants, swapped whole by a reload, and the limiter counting their
// use (in memory, or in a Redis shared by the replicas).
type tenancy struct {
	set     atomic.Pointer[tenant.Set]
	limiter *tenant.Limiter
}

// newTenancy builds the tenants of cfg and their limiter, and says at startup what a request
// will meet: limits without keys (everyone is tenant default), the store and its failure mode.
func newTenancy(cfg config.Config, m *metrics.Metrics, log *slog.Logger) (*tenancy, error) {
	set, err := tenant.Build(cfg, os.Getenv)
	if err != nil {
		return nil, err
	}
	t := &tenancy{limiter: tenant.NewLimiter(log)}
	t.set.Store(set)
	t.limiter.Timeout, t.limiter.FailClosed = cfg.RateLimitStoreTimeout, cfg.RateLimitStoreFailure == "closed"
	t.limiter.Hold = cfg.RequestTimeout + time.Minute
	if cfg.RateLimitStore != "" && cfg.RateLimitStore != "memory" {
		o, err := tenant.RedisOptions(cfg.RateLimitStore, os.Getenv)
		if err != nil {
			return nil, err
		}
		t.limiter.UseRedis(o)
		m.Registry.MustRegister(prometheus.NewGaugeFunc(prometheus.GaugeOpts{Name: "baton_rate_limit_store_up",
			Help: "1 while the Redis store of tenants' limits answers; 0 while it does not (requests are counted in this replica, or refused, per rate_limit_store_failure)."},
			func() float64 {
				if t.limiter.StoreUp() {
					return 1
				}
				return 0
			}))
	}
	return t, nil
}

// logTenants says at startup who may call and where their limits are counted.
func logTenants(log *slog.Logger, cfg config.Config, t *tenancy) {
	set := t.set.Load()
	if set.Open() && cfg.TenantsLimited() && !cfg.TrustTenantHeader {
		log.Warn("tenants have limits but no tenant has a key: every request is tenant default, with its limits; give tenants keys to tell them apart")
	}
	if !set.Open() {
		store := "memory (this replica)"
		if cfg.RateLimitStore != "memory" {
			store = config.RedactURL(cfg.RateLimitStore) + ", failing " + cfg.RateLimitStoreFailure
		}
		log.Info("tenants", "names", set.Names(), "limits_counted_in", store)
	}
}

// swap makes cfg's tenants the ones requests meet from now on (a reload): a rotated key works
// on the next request, a removed one fails on it; requests in flight finish.
func (t *tenancy) swap(cfg config.Config) error {
	set, err := tenant.Build(cfg, os.Getenv)
	if err != nil {
		return err
	}
	t.set.Store(set)
	return nil
}

// notices are the status page's words on the store: shown while it cannot be reached.
func (t *tenancy) notices() []server.Notice {
	if !t.limiter.Shared() || t.limiter.StoreUp() {
		return nil
	}
	mode := "requests are counted in each replica alone meanwhile (rate_limit_store_failure: open)"
	if t.limiter.FailClosed {
		mode = "requests of limited tenants are refused meanwhile (rate_limit_store_failure: closed)"
	}
	return []server.Notice{{Level: "bad", Text: "Tenants' rate limit store (Redis) cannot be reached: " + mode + "."}}
}
