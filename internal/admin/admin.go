// Package admin is Baton's operator API: the fleet's workers as GET /workers shows them, the
// worker routes that change the fleet while Baton runs (POST, PATCH, DELETE /workers), the
// tenants with their use (GET /tenants), and the admin key that guards them.
package admin

import (
	"bytes"
	"cmp"
	"crypto/subtle"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"mime"
	"net"
	"net/http"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/baton-llm/baton/internal/config"
	"github.com/baton-llm/baton/internal/director"
	"github.com/baton-llm/baton/internal/openai"
	"github.com/baton-llm/baton/internal/pd"
	"github.com/baton-llm/baton/internal/worker"
)

// Fleet is what the admin API changes: the workers, while Baton runs.
type Fleet interface {
	Add(c config.Worker, source string) (*worker.Worker, error)
	Update(id string, p config.WorkerPatch, source string) (*worker.Worker, error)
	Remove(id, source string) (*worker.Worker, error)
}

// Options are the admin API's settings and the parts it shows and changes.
type Options struct {
	// Keys, when any is set, are what the admin routes require as "Authorization: Bearer
	// <key>" (one of them; none is the inference key).
	Keys []string
	// Open allows the admin routes without a key: they have a listener of their own, on
	// loopback only — never the API listener, which a proxy on the same host makes look local
	// for everyone. Even then a keyless request that came through a proxy or from a web page
	// (a forwarding header or a browser's: proxied) or names a host that is not loopback (DNS
	// rebinding) is refused. With neither key nor Open, they answer 403.
	Open bool
	// Separate: the admin routes have their own listener (AdminHandler); the API listener keeps
	// GET /workers only.
	Separate bool
	Fleet    Fleet
	// SourceOf names where a worker came from (config, admin, kubernetes) for GET /workers.
	SourceOf func(url string) string
	// KVConnector is the connector of vLLM prefill workers that configure none (GET /workers).
	KVConnector string
	// KVEventsView, when set, gives a worker's KV event subscription for GET /workers (nil:
	// not subscribed).
	KVEventsView func(*worker.Worker) any
}

// API is the admin API over a director's fleet and tenants.
type API struct {
	o   Options
	d   *director.Director
	reg *worker.Registry
}

// New returns the admin API with o over d's fleet and tenants.
func New(o Options, d *director.Director) *API { return &API{o: o, d: d, reg: d.Registry()} }

// maxAdminBody bounds an admin request's body.
const maxAdminBody = 1 << 20

// Routes mounts the worker routes. own says the mux is the admin listener's; on the API
// listener, GET /workers also takes the inference key (it always has: authed checks it).
func (s *API) Routes(mux *http.ServeMux, own bool, authed func(http.Handler) http.Handler) {
	list := s.adminAuthed(http.HandlerFunc(s.serveWorkers))
	if !own {
		list = s.APIWorkers(authed)
	}
	mux.Handle("GET /workers", list)
	mux.Handle("GET /tenants", s.adminAuthed(http.HandlerFunc(s.serveTenants)))
	if s.o.Fleet == nil {
		return
	}
	mux.Handle("GET /workers/{id}", s.adminAuthed(http.HandlerFunc(s.serveWorker)))
	mux.Handle("POST /workers", s.adminAuthed(http.HandlerFunc(s.addWorker)))
	mux.Handle("PATCH /workers/{id}", s.adminAuthed(http.HandlerFunc(s.patchWorker)))
	mux.Handle("DELETE /workers/{id}", s.adminAuthed(http.HandlerFunc(s.deleteWorker)))
}

// APIWorkers is GET /workers on the API listener: the whole fleet — every engine's URL, model
// and adapter — so the operator's. With the admin key it answers; where the fleet has one
// client, unrestricted (no tenants: none or --api-key's alone), it answers that client, as it
// always has; a key of one tenant among several (or of one limited to some models) is 403
// admin_key_required: a tenant sees only its own models (GET /v1/models), never the fleet
// behind them.
func (s *API) APIWorkers(authed func(http.Handler) http.Handler) http.Handler {
	list := http.HandlerFunc(s.serveWorkers)
	return s.adminOr(authed(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if s.FleetPrivate() {
			openai.WriteError(w, &openai.Error{Status: http.StatusForbidden, Code: openai.CodeAdminKeyRequired,
				Message: "GET /workers shows the whole fleet: it takes the admin API key (--admin-api-key), not a tenant's key"})
			return
		}
		list(w, r)
	})), list)
}

// FleetPrivate reports whether the fleet is more than one client's to see: there are tenants
// (more than one, or one limited to some models), each of which sees only its own models.
func (s *API) FleetPrivate() bool {
	ts := s.d.Tenants().Tenants()
	return len(ts) > 1 || len(ts) == 1 && len(ts[0].Models()) > 0
}

// Keyed reports whether an admin key is set.
func (s *API) Keyed() bool { return len(s.o.Keys) > 0 }

// KeyOK reports whether r carries the admin key (false when none is set).
func (s *API) KeyOK(r *http.Request) bool {
	got := r.Header["Authorization"]
	return len(got) == 1 && s.IsKey(strings.TrimPrefix(got[0], "Bearer ")) && strings.HasPrefix(got[0], "Bearer ")
}

// IsKey reports whether key is one of the admin keys, comparing each in constant time.
func (s *API) IsKey(key string) bool {
	ok := 0
	for _, k := range s.o.Keys {
		ok |= subtle.ConstantTimeCompare([]byte(key), []byte(k))
	}
	return ok == 1
}

// adminOr serves admin with the admin key, else other.
func (s *API) adminOr(other, admin http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if s.KeyOK(r) {
			r.Header.Del("Authorization")
			admin.ServeHTTP(w, r)
			return
		}
		other.ServeHTTP(w, r)
	})
}

// adminAuthed lets a request through with the admin key, or without one where the admin API is
// open (loopback); 401 with a wrong key, 403 where no key is set and the listener is not
// loopback.
func (s *API) adminAuthed(next http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		a := s.o
		if len(r.Header["Authorization"]) > 1 {
			openai.WriteError(w, &openai.Error{Status: http.StatusBadRequest, Code: openai.CodeDuplicateHeader,
				Message: "the request has more than one Authorization header"})
			return
		}
		switch {
		case len(a.Keys) > 0 && !s.KeyOK(r):
			openai.WriteError(w, &openai.Error{Status: http.StatusUnauthorized, Code: openai.CodeInvalidAPIKey,
				Message: "missing or invalid admin API key: send 'Authorization: Bearer <admin key>'"})
			return
		case len(a.Keys) == 0 && !a.Open:
			openai.WriteError(w, &openai.Error{Status: http.StatusForbidden, Code: openai.CodeAdminDisabled,
				Message: "the admin API needs --admin-api-key, or a listener of its own on loopback only (--admin-host 127.0.0.1 --admin-port N)"})
			return
		case len(a.Keys) == 0 && (proxied(r.Header) || !loopbackHost(r.Host)):
			openai.WriteError(w, &openai.Error{Status: http.StatusForbidden, Code: openai.CodeAdminDisabled,
				Message: "a keyless admin request must come straight from this host: this one came through a proxy or from a web page (a forwarding header — Forwarded, X-Forwarded-*, X-Real-IP, Via, … — or a browser's: Origin, Referer, Sec-Fetch-*) or names another host; send the admin API key"})
			return
		case (r.Method == http.MethodPost || r.Method == http.MethodPatch) && !jsonBody(r.Header):
			openai.WriteError(w, &openai.Error{Status: http.StatusUnsupportedMediaType, Code: openai.CodeUnsupportedMedia,
				Message: "the admin API takes Content-Type: application/json"})
			return
		}
		r.Header.Del("Authorization")
		next.ServeHTTP(w, r)
	})
}

// proxyHeaders are the headers a proxy adds to name the client it forwards for — the standard
// ones, nginx's common proxy_set_header X-Real-IP, CDNs' and load balancers' own — and
// browserHeaders those a browser adds to a page's request.
var (
	proxyHeaders = []string{"Forwarded", "Via", "X-Real-Ip", "True-Client-Ip", "Cf-Connecting-Ip", "X-Client-Ip",
		"X-Cluster-Client-Ip", "Fastly-Client-Ip", "Client-Ip", "X-Original-Forwarded-For", "X-Envoy-External-Address",
		"X-Proxyuser-Ip", "Akamai-Origin-Hop"}
	browserHeaders = []string{"Origin", "Referer", "Cookie"}
)

// proxied reports whether a request carries what a proxy or a browser adds: proxyHeaders,
// browserHeaders, Sec-Fetch-*, and any name that speaks of forwarding or of a client's address
// (…Forwarded…, …-IP), read without regard to case or to '_' for '-' (X_Forwarded_For,
// X-Appengine-User-IP). Such a request is not the local operator's, whatever address it came
// from.
func proxied(h http.Header) bool {
	for k := range h {
		n := strings.ReplaceAll(strings.ToLower(k), "_", "-")
		if slices.ContainsFunc(proxyHeaders, func(p string) bool { return strings.EqualFold(p, n) }) ||
			slices.ContainsFunc(browserHeaders, func(p string) bool { return strings.EqualFold(p, n) }) ||
			strings.HasPrefix(n, "sec-fetch-") || strings.Contains(n, "forwarded") || strings.HasSuffix(n, "-ip") || n == "x-real-ip" {
			return true
		}
	}
	return false
}

// loopbackHost reports whether a request's Host names this host's loopback.
func loopbackHost(host string) bool {
	if h, _, err := net.SplitHostPort(host); err == nil {
		host = h
	}
	host = strings.Trim(host, "[]")
	if host == "localhost" {
		return true
	}
	ip := net.ParseIP(host)
	return ip != nil && ip.IsLoopback()
}

// jsonBody reports whether the request's body is declared JSON: a web page cannot send that
// cross-origin without the browser asking first.
func jsonBody(h http.Header) bool {
	mt, _, err := mime.ParseMediaType(h.Get("Content-Type"))
	return err == nil && mt == "application/json"
}

// addRequest is POST /workers' body: the YAML worker fields, plus smg's names for two of them.
type addRequest struct {
	config.Worker
	WorkerType  string `json:"worker_type"`
	RuntimeType string `json:"runtime_type"`
}

func (s *API) addWorker(w http.ResponseWriter, r *http.Request) {
	var req addRequest
	if !decodeAdmin(w, r, &req) {
		return
	}
	c := req.Worker
	if req.WorkerType != "" {
		if c.Role != "" && c.Role != req.WorkerType {
			adminError(w, http.StatusBadRequest, openai.CodeBadRequest, "role and worker_type disagree")
			return
		}
		c.Role = req.WorkerType
	}
	if req.RuntimeType != "" {
		if c.Runtime != "" && c.Runtime != req.RuntimeType {
			adminError(w, http.StatusBadRequest, openai.CodeBadRequest, "runtime and runtime_type disagree")
			return
		}
		c.Runtime = req.RuntimeType
	}
	if c.URL == "" {
		adminError(w, http.StatusBadRequest, openai.CodeBadRequest, "url is required")
		return
	}
	wk, err := s.o.Fleet.Add(c, "admin")
	if err != nil {
		fleetError(w, err, c.URL)
		return
	}
	loc := "/workers/" + wk.ID
	w.Header().Set("Location", loc)
	writeAdmin(w, http.StatusAccepted, map[string]any{"status": "accepted", "worker_id": wk.ID, "url": wk.URL, "location": loc,
		"message": "worker added: it registers in the background and takes traffic once its engine answers"})
}

func (s *API) patchWorker(w http.ResponseWriter, r *http.Request) {
	var p config.WorkerPatch
	if !decodeAdmin(w, r, &p) {
		return
	}
	wk, err := s.o.Fleet.Update(r.PathValue("id"), p, "admin")
	if err != nil {
		fleetError(w, err, r.PathValue("id"))
		return
	}
	writeAdmin(w, http.StatusAccepted, map[string]any{"status": "accepted", "worker_id": wk.ID, "worker": s.View(wk, time.Now()),
		"message": "worker updated: new requests use the new settings, requests in flight finish with the old"})
}

func (s *API) deleteWorker(w http.ResponseWriter, r *http.Request) {
	wk, err := s.o.Fleet.Remove(r.PathValue("id"), "admin")
	if err != nil {
		fleetError(w, err, r.PathValue("id"))
		return
	}
	writeAdmin(w, http.StatusAccepted, map[string]any{"status": "accepted", "worker_id": wk.ID, "in_flight": wk.InFlight(),
		"message": "worker draining: it takes no new requests and leaves once those in flight finish"})
}

func (s *API) serveWorker(w http.ResponseWriter, r *http.Request) {
	wk := s.reg.Snapshot().Get(r.PathValue("id"))
	if wk == nil {
		fleetError(w, worker.ErrNotFound, r.PathValue("id"))
		return
	}
	writeAdmin(w, http.StatusOK, s.View(wk, time.Now()))
}

// decodeAdmin reads a JSON body strictly (unknown fields are errors, one value, bounded);
// false when it answered the error itself.
func decodeAdmin(w http.ResponseWriter, r *http.Request, v any) bool {
	body, err := io.ReadAll(io.LimitReader(r.Body, maxAdminBody+1))
	if err != nil {
		adminError(w, http.StatusBadRequest, openai.CodeBadRequest, "cannot read the body")
		return false
	}
	if len(body) > maxAdminBody {
		adminError(w, http.StatusRequestEntityTooLarge, openai.CodePayloadTooLarge, fmt.Sprintf("body exceeds %d bytes", maxAdminBody))
		return false
	}
	dec := json.NewDecoder(bytes.NewReader(body))
	dec.DisallowUnknownFields()
	if err := dec.Decode(v); err != nil {
		adminError(w, http.StatusBadRequest, openai.CodeInvalidJSON, "invalid JSON body: "+err.Error())
		return false
	}
	if dec.More() {
		adminError(w, http.StatusBadRequest, openai.CodeInvalidJSON, "invalid JSON body: more than one value")
		return false
	}
	return true
}

// fleetError answers a fleet change's error: 409 exists, 404 not found, 400 invalid.
func fleetError(w http.ResponseWriter, err error, what string) {
	what = config.RedactURL(what)
	switch {
	case errors.Is(err, worker.ErrExists):
		adminError(w, http.StatusConflict, openai.CodeWorkerExists, fmt.Sprintf("a worker at %s already exists: PATCH /workers/%s to change it", what, worker.ID(what)))
	case errors.Is(err, worker.ErrNotFound):
		adminError(w, http.StatusNotFound, openai.CodeWorkerNotFound, "no worker "+printableID(what))
	case errors.Is(err, config.ErrInvalidWorker):
		adminError(w, http.StatusBadRequest, openai.CodeBadRequest, err.Error())
	default:
		adminError(w, http.StatusInternalServerError, openai.CodeInternalError, "the change failed")
	}
}

// printableID bounds an id echoed in a message.
func printableID(s string) string {
	if len(s) > 128 {
		s = s[:128]
	}
	return strconv.Quote(s)
}

func adminError(w http.ResponseWriter, status int, code, msg string) {
	openai.WriteError(w, &openai.Error{Status: status, Code: code, Message: msg})
}

func writeAdmin(w http.ResponseWriter, status int, v any) {
	body := openai.MarshalJSON(v)
	w.Header().Set("Content-Type", "application/json")
	w.Header().Set("Content-Length", strconv.Itoa(len(body)))
	w.WriteHeader(status)
	_, _ = w.Write(body)
}

// WorkerView is one worker in GET /workers and on the status page.
type WorkerView struct {
	ID       string `json:"id"`
	URL      string `json:"url"`
	Source   string `json:"source,omitempty"` // config, admin or kubernetes
	Draining bool   `json:"draining,omitempty"`
	Cordoned bool   `json:"cordoned,omitempty"` // its pod is not ready
	// Health sums up the above: ready, registering, unhealthy, circuit_open (healthy, but its
	// circuit is open: its engine failed requests), cordoned or draining.
	Health  string   `json:"health"`
	Breaker string   `json:"breaker"` // closed, open or half_open
	Role    string   `json:"role"`
	Runtime string   `json:"runtime,omitempty"`
	Models  []string `json:"models"`
	// Ready says the worker can be sent requests now: registered, healthy, neither drained nor
	// cordoned, and its circuit not open (worker.Routable).
	Ready         bool  `json:"ready"`
	Registered    bool  `json:"registered"`
	InFlight      int64 `json:"in_flight"`
	Successes     int64 `json:"successes"`
	Failures      int64 `json:"failures"`
	BootstrapPort *int  `json:"bootstrap_port,omitempty"`
	// BootstrapMismatch says that an SGLang prefill's engine reports another bootstrap port than
	// bootstrap_port (its /server_info disaggregation_bootstrap_port), and which.
	BootstrapMismatch string `json:"bootstrap_port_mismatch,omitempty"`
	DPSize            int    `json:"dp_size,omitempty"`
	// DPInFlight is the legs Baton has in flight on each DP rank (which it balances).
	DPInFlight []int64 `json:"dp_in_flight,omitempty"`
	// KVConnector is the effective connector mode of a vLLM prefill worker.
	KVConnector string            `json:"kv_connector,omitempty"`
	KVDetail    string            `json:"kv_connector_detail,omitempty"`
	Labels      map[string]string `json:"labels,omitempty"`
	// Engine is the load the engine last reported; Fresh says whether routing still trusts it.
	Engine *engineView `json:"engine_load,omitempty"`
	// Correlation is how an answer of the worker's is proven its request's before it is
	// relayed: "x-request-id" (its engine echoes the id Baton sends), "answer-id" (its engine
	// names its answers after it: chatcmpl-<id>), or "none" (neither seen: an answer out of step
	// on a reused connection cannot be told; --upstream-reuse off gives each request a
	// connection of its own).
	Correlation string `json:"correlation"`
	// KVEvents is Baton's subscription to the engine's KV events, when it has one.
	KVEvents any `json:"kv_events,omitempty"`
	// HealthCheck is what its health probes got, once one failed: the probes failed in a row
	// (0 while they pass) and the last failure — its cause, status, the start of the engine's
	// answer or the error, and when.
	HealthCheck *healthCheckView `json:"health_check,omitempty"`
}

// healthCheckView is a worker's failed health probes in GET /workers.
type healthCheckView struct {
	Failing     int                   `json:"failing"`
	LastFailure *worker.HealthFailure `json:"last_failure"`
}

// engineView is a worker's engine-reported load in GET /workers.
type engineView struct {
	Running *float64 `json:"running,omitempty"`
	Waiting *float64 `json:"waiting,omitempty"`
	KVUsage *float64 `json:"kv_usage,omitempty"`
	AgeMs   int64    `json:"age_ms"`
	Fresh   bool     `json:"fresh"`
}

func engineOf(w *worker.Worker, now time.Time) *engineView {
	l := w.EngineLoad()
	if l.At.IsZero() {
		return nil
	}
	v := &engineView{AgeMs: now.Sub(l.At).Milliseconds(), Fresh: l.Fresh(now)}
	if l.HasRunning {
		v.Running = &l.Running
	}
	if l.HasWaiting {
		v.Waiting = &l.Waiting
	}
	if l.HasKV {
		v.KVUsage = &l.KVUsage
	}
	return v
}

// serveWorkers answers GET /workers: every worker with its live state and, for vLLM prefill
// workers, the effective KV connector mode.
func (s *API) serveWorkers(w http.ResponseWriter, _ *http.Request) {
	out := []WorkerView{}
	now := time.Now()
	for _, wk := range s.reg.Snapshot().Workers {
		out = append(out, s.View(wk, now))
	}
	body := openai.MarshalJSON(map[string]any{"workers": out, "total": len(out)})
	w.Header().Set("Content-Type", "application/json")
	w.Header().Set("Content-Length", strconv.Itoa(len(body)))
	_, _ = w.Write(body)
}

// View is one worker's state as GET /workers shows it (never its api_key).
func (s *API) View(wk *worker.Worker, now time.Time) WorkerView {
	ok, failed := wk.Outcomes()
	v := WorkerView{ID: wk.ID, URL: wk.URL, Draining: wk.Draining(), Cordoned: wk.Cordoned(), Role: wk.Role, Runtime: wk.Runtime(), Models: []string{}, Ready: wk.Routable(),
		Registered: wk.Registered(), InFlight: wk.InFlight(), Successes: ok, Failures: failed,
		BootstrapPort: wk.BootstrapPort, DPSize: wk.DPSize, Labels: wk.Labels, Engine: engineOf(wk, now), Correlation: wk.Correlation()}
	if s.o.SourceOf != nil {
		v.Source = s.o.SourceOf(wk.URL)
	}
	v.BootstrapMismatch = wk.BootstrapMismatch()
	if failing, last := wk.HealthCheck(); last != nil {
		v.HealthCheck = &healthCheckView{Failing: failing, LastFailure: last}
	}
	v.Breaker = wk.BreakerState().String()
	switch {
	case v.Draining:
		v.Health = "draining"
	case v.Cordoned:
		v.Health = "cordoned"
	case !v.Registered:
		v.Health = "registering"
	case v.Ready:
		v.Health = "ready"
	case wk.Ready():
		v.Health = "circuit_open"
	default:
		v.Health = "unhealthy"
	}
	if in := wk.Info(); in != nil {
		for _, m := range in.Models {
			v.Models = append(v.Models, m.ID)
		}
	}
	dp := wk.DPSize
	switch {
	case wk.Role == config.RolePrefill && wk.Runtime() == config.RuntimeVLLM:
		c := pd.ConnectorFor(wk, s.o.KVConnector)
		v.KVConnector, v.KVDetail = c.Mode, c.String()
		dp = max(dp, c.DPSize)
	case wk.Role == config.RoleDecode && wk.Runtime() == config.RuntimeVLLM:
		// The connector a decode's pairing reads (pd.Compatible): its own, else the default.
		if name := cmp.Or(wk.KVConnector, s.o.KVConnector); name != "" {
			v.KVConnector, _ = config.KVConnectorMode(name)
		}
	}
	v.DPInFlight = wk.RankInFlight(dp)
	if s.o.KVEventsView != nil {
		v.KVEvents = s.o.KVEventsView(wk)
	}
	return v
}

// serveTenants is GET /tenants: every tenant's limits and its use now.
func (s *API) serveTenants(w http.ResponseWriter, r *http.Request) {
	views, err := s.d.TenantViews(r.Context())
	out := map[string]any{"tenants": views, "store": "memory"}
	if s.d.Tenancy().Limiter.Shared() {
		out["store"], out["store_up"] = "redis", err == nil && s.d.Tenancy().Limiter.StoreUp()
	}
	writeAdmin(w, http.StatusOK, out)
}
