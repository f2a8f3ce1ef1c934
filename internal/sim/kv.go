package sim

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/url"
	"sort"
	"strconv"
	"sync"
	"time"
)

// kvParams is vLLM's kv_transfer_params as the simulator reads it.
type kvParams struct {
	DoRemoteDecode      bool    `json:"do_remote_decode"`
	DoRemotePrefill     bool    `json:"do_remote_prefill"`
	RemoteEngineID      *string `json:"remote_engine_id"`
	RemoteBlockIDs      []int   `json:"remote_block_ids"`
	RemoteRequestID     *string `json:"remote_request_id"`
	RemoteHost          *string `json:"remote_host"`
	RemotePort          *int    `json:"remote_port"`
	TransferID          *string `json:"transfer_id"`
	RemoteBootstrapAddr *string `json:"remote_bootstrap_addr"`
}

// blockSize is the simulated KV block size in tokens.
const blockSize = 16

// pinnedKV is prefill KV held for a decode engine.
type pinnedKV struct {
	ID           string    `json:"id"`
	Connector    string    `json:"connector"`
	EngineID     string    `json:"engine_id"`
	PromptTokens int       `json:"prompt_tokens"`
	Digest       string    `json:"digest"`
	PinnedAt     time.Time `json:"pinned_at"`
	ExpiresAt    time.Time `json:"expires_at"`
	// Stale marks blocks read after the prefill freed them (pulled before, or released when a
	// decode refused the request): the read succeeds, but the blocks may hold another request's
	// KV. vLLM can only log "Potentially invalid KV blocks"; the decode answers from them.
	Stale bool `json:"stale,omitempty"`
	timer *time.Timer
}

// maxFreed bounds the ids a prefill remembers as freed, oldest forgotten first.
const maxFreed = 4096

// kvStore holds pinned KV until a decode engine takes it or it expires.
type kvStore struct {
	e       *Engine
	mu      sync.Mutex
	m       map[string]*pinnedKV
	waiters map[string][]chan struct{}
	// freed are ids whose blocks were given back (pulled, or released on a decode's refusal),
	// in order, for stale reads.
	freed     map[string]*pinnedKV
	freedList []string
}

func newKVStore(e *Engine) *kvStore {
	return &kvStore{e: e, m: map[string]*pinnedKV{}, waiters: map[string][]chan struct{}{}, freed: map[string]*pinnedKV{}}
}

// free remembers p as freed; s.mu is held.
func (s *kvStore) free(p *pinnedKV) {
	if len(s.freedList) >= maxFreed {
		delete(s.freed, s.freedList[0])
		s.freedList = s.freedList[1:]
	}
	s.freed[p.ID] = p
	s.freedList = append(s.freedList, p.ID)
}

// release frees the KV pinned under id for engineID at once: a decode engine refused the
// request it was meant for (vLLM's notify_kv_transfer_request_rejected). It reports whether
// anything was pinned.
func (s *kvStore) release(id, engineID string) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	p, ok := s.m[id]
	if !ok || p.EngineID != engineID {
		return false
	}
	delete(s.m, id)
	p.timer.Stop()
	s.free(p)
	s.e.stats.released.Add(1)
	return true
}

func (s *kvStore) pin(p *pinnedKV) {
	p.PinnedAt = time.Now()
	p.ExpiresAt = p.PinnedAt.Add(s.e.cfg.KVTimeout)
	s.mu.Lock()
	defer s.mu.Unlock()
	s.m[p.ID] = p
	s.e.stats.pinned.Add(1)
	p.timer = time.AfterFunc(s.e.cfg.KVTimeout, func() {
		s.mu.Lock()
		defer s.mu.Unlock()
		if s.m[p.ID] == p {
			delete(s.m, p.ID)
			s.e.stats.expired.Add(1)
		}
	})
	for _, ch := range s.waiters[p.ID] {
		close(ch)
	}
	delete(s.waiters, p.ID)
}

// take removes and returns the KV pinned under id for engineID.
func (s *kvStore) take(id, engineID string) (*pinnedKV, *apiError) {
	s.mu.Lock()
	defer s.mu.Unlock()
	p, ok := s.m[id]
	if !ok {
		if f, was := s.freed[id]; was && f.EngineID == engineID {
			// The blocks were freed and may already hold another request's KV: the read goes
			// through, and the decode builds its answer on whatever they hold.
			s.e.stats.staleReads.Add(1)
			stale := *f
			stale.Stale, stale.timer = true, nil
			return &stale, nil
		}
		return nil, errorf(http.StatusNotFound, "no KV pinned under %q (unknown or expired)", id)
	}
	if p.EngineID != engineID {
		return nil, errorf(http.StatusConflict, "KV %q belongs to engine %q, not %q", id, p.EngineID, engineID)
	}
	delete(s.m, id)
	p.timer.Stop()
	s.free(p)
	s.e.stats.pulled.Add(1)
	return p, nil
}

// wait is take, waiting up to timeout for the KV to be pinned (Mooncake: decode may arrive
// before the prefill finished).
func (s *kvStore) wait(ctx context.Context, id, engineID string, timeout time.Duration) (*pinnedKV, *apiError) {
	deadline := time.NewTimer(timeout)
	defer deadline.Stop()
	for {
		s.mu.Lock()
		_, ok := s.m[id]
		if _, gone := s.freed[id]; !ok && gone {
			s.mu.Unlock()
			return nil, errorf(http.StatusGone, "transfer %q was already sent or released", id)
		}
		var ch chan struct{}
		if !ok {
			ch = make(chan struct{})
			s.waiters[id] = append(s.waiters[id], ch)
		}
		s.mu.Unlock()
		if ok {
			return s.take(id, engineID)
		}
		select {
		case <-ch:
		case <-deadline.C:
			return nil, errorf(http.StatusNotFound, "timed out after %s waiting for KV %q", timeout, id)
		case <-ctx.Done():
			return nil, errorf(499, "decode left while waiting for KV %q", id)
		}
	}
}

func (s *kvStore) list() []*pinnedKV {
	s.mu.Lock()
	defer s.mu.Unlock()
	out := make([]*pinnedKV, 0, len(s.m))
	for _, p := range s.m {
		out = append(out, p)
	}
	sort.Slice(out, func(i, j int) bool { return out[i].PinnedAt.Before(out[j].PinnedAt) })
	return out
}

func (s *kvStore) close() {
	s.mu.Lock()
	defer s.mu.Unlock()
	for _, p := range s.m {
		p.timer.Stop()
	}
}

// sideRoutes is the NIXL side channel of one DP rank: decode engines pull pinned KV here.
func (e *Engine) sideRoutes(rank int) http.Handler {
	mux := http.NewServeMux()
	mux.HandleFunc("GET /nixl/pull", func(w http.ResponseWriter, r *http.Request) {
		q := r.URL.Query()
		p, aerr := e.kv.take(q.Get("request_id"), q.Get("engine_id"))
		if aerr != nil {
			writeJSON(w, aerr.status, map[string]any{"error": aerr.msg})
			return
		}
		writeJSON(w, 200, p)
	})
	mux.HandleFunc("POST /nixl/release", e.serveRelease("request_id"))
	return mux
}

// serveRelease frees the KV a decode engine refused, keyed by the query parameter key.
func (e *Engine) serveRelease(key string) http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		q := r.URL.Query()
		writeJSON(w, 200, map[string]any{"released": e.kv.release(q.Get(key), q.Get("engine_id"))})
	}
}

// bootstrapRoutes is the bootstrap server of a prefill engine: a vLLM engine's Mooncake
// query/register and KV fetch, an SGLang engine's rendezvous by room — each engine only its
// own, as the real servers (another engine's route is a 404).
func (e *Engine) bootstrapRoutes() http.Handler {
	mux := http.NewServeMux()
	mux.HandleFunc("GET /health", func(w http.ResponseWriter, _ *http.Request) { w.WriteHeader(200) })
	if e.cfg.Engine == EngineSGLang {
		mux.HandleFunc("GET /route", func(w http.ResponseWriter, _ *http.Request) {
			writeJSON(w, 200, map[string]any{"prefill_dp_size": e.cfg.DPSize, "prefill_tp_size": 1})
		})
		mux.HandleFunc("POST /bootstrap/join", e.serveJoin)
		return mux
	}
	mux.HandleFunc("GET /query", func(w http.ResponseWriter, _ *http.Request) {
		if time.Since(e.started) < e.cfg.MooncakeRegistering {
			writeJSON(w, 503, map[string]any{"detail": fmt.Sprintf("Workers still registering: 0/%d", len(e.engineIDs))})
			return
		}
		out := map[string]any{}
		for r, id := range e.engineIDs {
			addr := map[string]any{"0": map[string]any{"0": e.Addr()}}
			if e.cfg.MooncakeQueryByEngineID {
				ranks, _ := out[id].(map[string]any)
				if ranks == nil {
					ranks = map[string]any{}
					out[id] = ranks
				}
				ranks[strconv.Itoa(r)] = addr
				continue
			}
			out[strconv.Itoa(r)] = map[string]any{"engine_id": id, "worker_addr": addr}
		}
		writeJSON(w, 200, out)
	})
	mux.HandleFunc("POST /register", func(w http.ResponseWriter, _ *http.Request) { writeJSON(w, 200, map[string]any{"ok": true}) })
	mux.HandleFunc("GET /mooncake/fetch", func(w http.ResponseWriter, r *http.Request) {
		q := r.URL.Query()
		timeout, _ := time.ParseDuration(q.Get("timeout"))
		if timeout <= 0 {
			timeout = e.cfg.KVTimeout
		}
		p, aerr := e.kv.wait(r.Context(), q.Get("transfer_id"), q.Get("engine_id"), timeout)
		if aerr != nil {
			writeJSON(w, aerr.status, map[string]any{"error": aerr.msg})
			return
		}
		writeJSON(w, 200, p)
	})
	mux.HandleFunc("POST /mooncake/release", e.serveRelease("transfer_id"))
	return mux
}

// loadRemote loads the KV a decode request was told about. It returns loaded true when the KV
// was loaded, false to recompute, or an error to fail the request (kv-load-failure-policy
// fail); stale reports KV read from blocks the prefill had already freed, which the engine
// cannot tell from good KV.
func (e *Engine) loadRemote(ctx context.Context, kv *kvParams, prompt []uint32) (loaded, stale bool, aerr *apiError) {
	if kv == nil || !kv.DoRemotePrefill {
		return false, false, nil
	}
	u, eng, ok := e.kvSource(kv)
	if !ok {
		return false, false, nil
	}
	var p *pinnedKV
	var err error
	if src, id := e.sameProcessSource(kv); src != nil {
		var aerr *apiError
		if p, aerr = src.kv.take(id, eng); aerr != nil {
			p, err = nil, errors.New(aerr.msg)
		}
	} else {
		p, err = e.fetchKV(ctx, u)
	}
	switch {
	case err == nil && p.Stale:
		return true, true, nil
	case err == nil && p.Digest != fmt.Sprintf("%016x", Digest(prompt)):
		err = fmt.Errorf("KV from %s is for a different prompt", eng)
	case err == nil:
		return true, false, nil
	}
	if ctx.Err() != nil {
		return false, false, errorf(499, "client left")
	}
	e.stats.loadFail.Add(1)
	if e.cfg.KVLoadFailure == PolicyRecompute {
		return false, false, nil
	}
	return false, false, errorf(http.StatusInternalServerError, "KV load failed: %v", err)
}

// sameProcess holds the NIXL prefill engines of this process by the side-channel address their
// kv_transfer_params name (remote_host:remote_port), for Config.SameProcessKV.
var sameProcess sync.Map // string → *Engine

// sameProcessSource returns the prefill engine of this process that kv's NIXL params name and
// the request id to take, or nil when e does not take KV by a call or no such engine runs here.
// kv is params kvSource accepted: on a NIXL engine, whole NIXL params.
func (e *Engine) sameProcessSource(kv *kvParams) (*Engine, string) {
	if !e.cfg.SameProcessKV || e.cfg.KVConnector != ConnectorNixl {
		return nil, ""
	}
	src, ok := sameProcess.Load(netJoin(*kv.RemoteHost, *kv.RemotePort))
	if !ok {
		return nil, ""
	}
	return src.(*Engine), *kv.RemoteRequestID
}

// kvSource returns where this decode engine reads the KV that kv names (its side-channel or
// bootstrap URL) and the remote engine id, or ok false when its connector finds no transfer in
// them: the engine then recomputes, silently.
func (e *Engine) kvSource(kv *kvParams) (u, eng string, ok bool) {
	mooncake := kv.TransferID != nil || kv.RemoteBootstrapAddr != nil
	if (mooncake && e.cfg.KVConnector != ConnectorMooncake) || (!mooncake && e.cfg.KVConnector != ConnectorNixl) {
		// The engine's own connector reads the params: NIXL finds no block ids in Mooncake's
		// ("Got invalid KVTransferParams"), Mooncake no transfer_id in NIXL's. No transfer.
		e.stats.mismatch.Add(1)
		return "", "", false
	}
	if mooncake {
		if kv.TransferID == nil || kv.RemoteEngineID == nil || kv.RemoteBootstrapAddr == nil {
			return "", "", false // vLLM warns and does no transfer: a silent recompute
		}
		eng = *kv.RemoteEngineID
		return fmt.Sprintf("%s/mooncake/fetch?transfer_id=%s&engine_id=%s&timeout=%s", *kv.RemoteBootstrapAddr,
			url.QueryEscape(*kv.TransferID), url.QueryEscape(eng), e.cfg.BootstrapTimeout), eng, true
	}
	if len(kv.RemoteBlockIDs) == 0 || kv.RemoteEngineID == nil || kv.RemoteRequestID == nil || kv.RemoteHost == nil || kv.RemotePort == nil {
		return "", "", false // "Got invalid KVTransferParams": no transfer
	}
	eng = *kv.RemoteEngineID
	return fmt.Sprintf("http://%s/nixl/pull?request_id=%s&engine_id=%s", netJoin(*kv.RemoteHost, *kv.RemotePort),
		url.QueryEscape(*kv.RemoteRequestID), url.QueryEscape(eng)), eng, true
}

// refuseKV tells the prefill named in a refused decode request's kv_transfer_params to free
// the KV at once, as vLLM's serving layer does for a request it answers with an error before
// the engine takes it (_with_kv_transfer_rejection_cleanup → notify_kv_transfer_request_rejected,
// vLLM ≥ 0.21). body is the refused request's.
func (e *Engine) refuseKV(body []byte) {
	if e.cfg.Engine != EngineVLLM || e.cfg.Role == RolePrefill || e.cfg.KVConnector == ConnectorNone {
		return
	}
	var raw struct {
		KV *kvParams `json:"kv_transfer_params"`
	}
	if json.Unmarshal(body, &raw) != nil || raw.KV == nil || !raw.KV.DoRemotePrefill {
		return
	}
	kv := raw.KV
	var u string
	switch {
	case kv.TransferID != nil && kv.RemoteBootstrapAddr != nil && kv.RemoteEngineID != nil:
		u = fmt.Sprintf("%s/mooncake/release?transfer_id=%s&engine_id=%s", *kv.RemoteBootstrapAddr,
			url.QueryEscape(*kv.TransferID), url.QueryEscape(*kv.RemoteEngineID))
	case kv.RemoteHost != nil && kv.RemotePort != nil && kv.RemoteRequestID != nil && kv.RemoteEngineID != nil:
		u = fmt.Sprintf("http://%s/nixl/release?request_id=%s&engine_id=%s", netJoin(*kv.RemoteHost, *kv.RemotePort),
			url.QueryEscape(*kv.RemoteRequestID), url.QueryEscape(*kv.RemoteEngineID))
	default:
		return
	}
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, u, nil)
	if err != nil {
		return
	}
	if resp, err := e.client.Do(req); err == nil {
		_, _ = io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
	}
}

func (e *Engine) fetchKV(ctx context.Context, u string) (*pinnedKV, error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, u, nil)
	if err != nil {
		return nil, err
	}
	resp, err := e.client.Do(req)
	if err != nil {
		return nil, err
	}
	defer resp.Body.Close()
	if resp.StatusCode != 200 {
		var body struct {
			Error string `json:"error"`
		}
		_ = json.NewDecoder(resp.Body).Decode(&body)
		return nil, fmt.Errorf("%s", body.Error)
	}
	var p pinnedKV
	if err := json.NewDecoder(resp.Body).Decode(&p); err != nil {
		return nil, err
	}
	return &p, nil
}

func netJoin(host string, port int) string { return net.JoinHostPort(host, strconv.Itoa(port)) }
