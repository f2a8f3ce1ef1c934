package app

import (
	"bytes"
	"context"
	"crypto/sha256"
	"io"
	"os"
	"os/signal"
	"reflect"
	"strings"
	"syscall"
	"time"

	"github.com/baton-llm/baton/internal/config"
	"github.com/baton-llm/baton/internal/fleet"
	"github.com/baton-llm/baton/internal/policy"
)

// Reload parses the configuration again (the same flags, the --config file re-read) and applies
// it: the fleet's configured workers become what it lists (new ones added, changed ones updated,
// removed ones drained; workers the admin API or discovery added are left alone), the tenants
// and their keys are swapped whole (a rotated key works on the next request), and the routing
// policies and their parameters take effect for the next selection (a policy whose
// parameters changed starts with an empty prefix index). Every other setting needs a restart: a
// reload that changes one names each such setting in its log line and counts as partial, as
// does one where some worker was refused. An invalid configuration changes nothing.
func (g *Gateway) Reload() error {
	g.reloadMu.Lock()
	defer g.reloadMu.Unlock()
	cfg, err := config.Parse(g.Config.Args, io.Discard)
	if err != nil {
		g.Log.Error("reload: the configuration is invalid; nothing changed", "err", err)
		g.reloads.WithLabelValues("invalid").Inc()
		return err
	}
	live, restart := config.Changed(g.applied, cfg)
	if !reflect.DeepEqual(g.applied.Models, cfg.Models) {
		live = append(live, "models")
	}
	if !reflect.DeepEqual(g.applied.Adapters, cfg.Adapters) {
		live = append(live, "adapters")
	}
	var policies map[string]policy.Policy
	var modelPolicies map[string]map[string]policy.Policy
	if len(live) > 0 {
		if policies, modelPolicies, err = newPolicies(cfg, g.KVEvents); err != nil {
			g.Log.Error("reload: the configuration is invalid; nothing changed", "err", err)
			g.reloads.WithLabelValues("invalid").Inc()
			return err
		}
	}
	if err := g.tenants.swap(cfg); err != nil {
		g.Log.Error("reload: the configuration is invalid; nothing changed", "err", err)
		g.reloads.WithLabelValues("invalid").Inc()
		return err
	}
	var certErr error
	if g.cert != nil {
		if certErr = g.cert.load(); certErr != nil {
			g.Log.Error("reload: the TLS certificate could not be read; the one served stays", "err", certErr)
		}
	}
	defer g.Server.WarnUnservable("reload: models that no request can be sent for (the gateway stays ready while any model can be served)")
	werr := g.Fleet.Sync(cfg.AllWorkers(), fleet.SourceConfig)
	if policies != nil {
		g.Selector.SetPolicies(policies, modelPolicies)
		g.applied = config.WithLive(g.applied, cfg)
		g.applied.Models, g.applied.Adapters = cfg.Models, cfg.Adapters
		g.Adapters.Set(adapterSettings(g.applied))
		g.Adapters.ForgetFailures() // the operator may have fixed what failed
		g.models.Store(&modelNames{models: cfg.Models, def: cfg.DefaultModel})
	}
	attrs := []any{"workers", len(cfg.AllWorkers())}
	if len(live) > 0 {
		attrs = append(attrs, "applied", strings.Join(live, ", "), "policy", cfg.Policy)
		if cfg.PDDisaggregation {
			attrs = append(attrs, "prefill_policy", cfg.PolicyFor(config.RolePrefill), "decode_policy", cfg.PolicyFor(config.RoleDecode))
		}
	}
	switch {
	case werr != nil:
		g.reloads.WithLabelValues("partial").Inc()
		g.Log.Error("reload: some workers could not be applied", append(attrs, "err", werr, "need_restart", strings.Join(restart, ", "))...)
		return werr
	case certErr != nil:
		g.reloads.WithLabelValues("partial").Inc()
		g.Log.Warn("reload: applied, but not the TLS certificate: the one served stays", attrs...)
		return certErr
	case len(restart) > 0:
		g.reloads.WithLabelValues("partial").Inc()
		g.Log.Warn("reload: applied; these changed settings take effect only after a restart", append(attrs, "need_restart", strings.Join(restart, ", "))...)
		return nil
	}
	g.reloads.WithLabelValues("ok").Inc()
	g.Log.Info("reload: configuration applied", attrs...)
	return nil
}

// watchReload reloads on SIGHUP and, with watch_config, when the --config file's content
// changes (checked every interval; a Kubernetes ConfigMap's files are swapped, not written in
// place, so the content is compared, not the modification time), until ctx ends. A change is
// applied once the content has stayed the same for one more interval: a file being written in
// place (empty for a moment) is not taken for a fleet without workers.
func (g *Gateway) watchReload(ctx context.Context, interval time.Duration) {
	hup := make(chan os.Signal, 1)
	signal.Notify(hup, syscall.SIGHUP)
	defer signal.Stop(hup)
	var tick <-chan time.Time
	var file, cert steadySum
	watchFile := g.Config.WatchConfig && g.Config.File != ""
	if watchFile || g.cert != nil {
		t := time.NewTicker(interval)
		defer t.Stop()
		tick = t.C
		file.last = g.Config.FileSum
		if g.cert != nil {
			cert.last = g.cert.sum()
		}
	}
	for {
		select {
		case <-ctx.Done():
			return
		case <-hup:
			g.Log.Info("reload: SIGHUP")
			_ = g.Reload()
		case <-tick:
			// A renewed certificate (cert-manager rewriting its Secret) is reloaded.
			if g.cert != nil && cert.changed(g.cert.sum()) {
				g.Log.Info("reload: the TLS certificate files changed", "cert", g.Config.TLSCertPath)
				_ = g.Reload()
			}
			if watchFile && file.changed(fileSum(g.Config.File)) {
				g.Log.Info("reload: the configuration file changed", "file", g.Config.File)
				_ = g.Reload()
			}
		}
	}
}

// steadySum follows the content of files read every tick (their sum): a change counts once it
// held still for a tick, so that a file caught mid-write is not applied.
type steadySum struct{ last, pending []byte }

// changed takes this tick's sum (nil: unreadable, no change) and reports a settled change.
func (s *steadySum) changed(sum []byte) bool {
	switch {
	case sum == nil || bytes.Equal(sum, s.last):
		s.pending = nil
	case !bytes.Equal(sum, s.pending):
		s.pending = sum
	default:
		s.last, s.pending = sum, nil
		return true
	}
	return false
}

// fileSum is the SHA-256 of a file's content, nil when it cannot be read.
func fileSum(path string) []byte {
	b, err := config.ReadFile(path, config.MaxConfigFile)
	if err != nil {
		return nil
	}
	s := sha256.Sum256(b)
	return s[:]
}
