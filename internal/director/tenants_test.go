package director

import (
	"context"
	"encoding/json"
	"net/http"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/baton-llm/baton/internal/config"
	"github.com/baton-llm/baton/internal/openai"
	"github.com/baton-llm/baton/internal/pd"
	"github.com/baton-llm/baton/internal/proxy"
	"github.com/baton-llm/baton/internal/record"
	"github.com/baton-llm/baton/internal/tenant"
	"github.com/baton-llm/baton/internal/worker"
)

// tenantsOf is the default configuration with ts as its tenants.
func tenantsOf(ts ...config.Tenant) config.Config {
	cfg := config.Default()
	cfg.Tenants = ts
	return cfg
}

// keyedTenant is tenant name, whose key is "key-"+name, shaped by tune.
func keyedTenant(name string, tune ...func(*config.Tenant)) config.Tenant {
	t := config.Tenant{Name: name, Keys: []string{config.HashKey("key-" + name)}}
	for _, f := range tune {
		f(&t)
	}
	return t
}

// limits are a rule's limits (0: none).
func limits(rpm, tpm, conc int) *config.Limits {
	l := &config.Limits{}
	if rpm > 0 {
		l.RequestsPerMinute = intp(rpm)
	}
	if tpm > 0 {
		l.TokensPerMinute = intp(tpm)
	}
	if conc > 0 {
		l.MaxConcurrent = intp(conc)
	}
	return l
}

// tenantFleet is a director over one regular worker of "m", "big" and "small" with cfg's
// tenants, maxTokens reserved for a request without a cap.
func tenantFleet(t *testing.T, cfg config.Config, maxTokens int, tune ...func(*Options)) *fleet {
	t.Helper()
	return newFleet(t, []*worker.Worker{regular("http://a:8000", "m", "big", "small")},
		append([]func(*Options){withTenants(t, cfg, maxTokens)}, tune...)...)
}

// trial is one request through Admit: its record, its parsed body, what Admit took.
type trial struct {
	rec  *record.Record
	preq *pd.Request
	a    *Admitted
	ok   bool
}

// admitAs sends body to path as the tenant whose key is key ("" for none), with the priority
// headers baton and smg.
func (f *fleet) admitAs(t *testing.T, key, path, body, baton, smg string) trial {
	t.Helper()
	var auth []string
	if key != "" {
		auth = []string{"Bearer " + key}
	}
	who, _, e := f.d.Identify(auth, nil)
	if e != nil {
		t.Fatalf("identify %q: %+v", key, e)
	}
	req := parsed(t, body)
	rec := &record.Record{Model: req.Model, Who: who}
	preq := &pd.Request{Request: req, Path: path, Rec: rec}
	a, ok := f.d.Admit(context.Background(), rec, preq, baton, smg)
	if a == nil {
		t.Fatal("Admit returned no Admitted")
	}
	if ok != (a.Refusal == nil) {
		t.Fatalf("admitted %v with refusal %+v", ok, a.Refusal)
	}
	return trial{rec: rec, preq: preq, a: a, ok: ok}
}

// estimate is Baton's estimate of a prompt's tokens when no engine counted it: the body's
// bytes / 4, rounded up.
func estimate(body string) int { return (len(body) + 3) / 4 }

// ruleOf is tenant name's rule for model ("" for its tenant-wide rule).
func (f *fleet) ruleOf(t *testing.T, name, model string) *tenant.Rule {
	t.Helper()
	tn := f.d.Tenants().ByName(name)
	if tn == nil {
		t.Fatalf("no tenant %q", name)
	}
	for _, r := range tn.Rules() {
		if r.Model == model {
			return r
		}
	}
	t.Fatalf("tenant %q has no rule for %q", name, model)
	return nil
}

// peek is the rule's windows now.
func (f *fleet) peek(t *testing.T, r *tenant.Rule) tenant.Decision {
	t.Helper()
	d, err := f.d.Tenancy().Limiter.Peek(context.Background(), r)
	if err != nil {
		t.Fatal(err)
	}
	return d
}

// A tenant held to some models: another model is the 404 of a model nobody serves, its message
// true whether or not a worker serves it (never "not served" of a served model); /generate naming
// none is 400 model_required; a model it may use is admitted, with no limits to show.
func TestAdmitTenantModels(t *testing.T) {
	f := tenantFleet(t, tenantsOf(keyedTenant("a", func(c *config.Tenant) { c.Models = []string{"m", "sm*"} })), 1024)
	x := f.admitAs(t, "key-a", "/v1/chat/completions", `{"model":"big","messages":[]}`, "", "")
	x.a.End()
	if e := x.a.Refusal; x.ok || e.Status != http.StatusNotFound || e.Code != openai.CodeModelNotFound || e.Param != "model" ||
		strings.Contains(e.Message, "sm*") || strings.Contains(e.Message, "not served") || !strings.Contains(e.Message, "does not exist or you do not have access to it") {
		t.Errorf("a model the tenant may not use: %+v", e)
	}
	x = f.admitAs(t, "key-a", "/generate", `{"text":"hi"}`, "", "")
	x.a.End()
	if e := x.a.Refusal; x.ok || e.Status != http.StatusBadRequest || e.Code != openai.CodeModelRequired || e.Param != "model" {
		t.Errorf("/generate without a model: %+v", e)
	}
	for _, model := range []string{"m", "small"} {
		x = f.admitAs(t, "key-a", "/v1/chat/completions", `{"model":"`+model+`","messages":[]}`, "", "")
		if !x.ok || x.a.Limits != (tenant.Decision{}) || x.a.Orders != (proxy.Orders{}) || x.a.Class != "default" {
			t.Errorf("%s: admitted %v, limits %+v, orders %+v, class %q", model, x.ok, x.a.Limits, x.a.Orders, x.a.Class)
		}
		x.a.End()
	}
	if n := testutil.ToFloat64(f.m.ModelInFlight.WithLabelValues("m")); n != 0 {
		t.Errorf("%v requests in flight for m after every End", n)
	}
}

// requests_per_minute: the limit's burst is admitted, each showing what remains; the next is
// 429 tenant_rate_limit_exceeded with Retry-After (the time a request is back: a minute / the
// limit), the windows, and a rejection counted; nothing is given back by End.
func TestAdmitRequestsPerMinute(t *testing.T) {
	f := tenantFleet(t, tenantsOf(keyedTenant("a", func(c *config.Tenant) { c.Limits = limits(2, 0, 0) })), 1024)
	body := `{"model":"m","messages":[]}`
	for i := range 2 {
		x := f.admitAs(t, "key-a", "/v1/chat/completions", body, "", "")
		if !x.ok || x.a.Limits.Requests.Limit != 2 || x.a.Limits.Requests.Remaining != 1-i || x.a.Limits.Tokens.Limit != 0 {
			t.Fatalf("request %d: admitted %v, limits %+v", i, x.ok, x.a.Limits)
		}
		if inFlight := testutil.ToFloat64(f.m.ModelInFlight.WithLabelValues(x.rec.ModelLabel)); inFlight != 1 {
			t.Errorf("request %d: %v in flight while admitted", i, inFlight)
		}
		x.a.End()
	}
	x := f.admitAs(t, "key-a", "/v1/chat/completions", body, "", "")
	x.a.End()
	e := x.a.Refusal
	if x.ok || e.Status != http.StatusTooManyRequests || e.Code != openai.CodeTenantRateLimit || e.NoRetry ||
		!strings.Contains(e.Message, "tenant a reached its limit of 2 requests per minute") {
		t.Fatalf("third request: %+v", e)
	}
	if s, err := strconv.Atoi(e.RetryAfter); err != nil || s < 25 || s > 30 {
		t.Errorf("Retry-After %q: want about 30 (a minute / 2 requests)", e.RetryAfter)
	}
	if x.a.Limits.Requests.Limit != 2 || x.a.Limits.Requests.Remaining != 0 {
		t.Errorf("refused: limits %+v", x.a.Limits)
	}
	if n := testutil.ToFloat64(f.m.TenantRejections.WithLabelValues("a", tenant.ReasonRequests)); n != 1 {
		t.Errorf("%v rejections for requests counted", n)
	}
	if d := f.peek(t, f.ruleOf(t, "a", "")); d.Requests.Remaining != 0 {
		t.Errorf("after End the requests window shows %d remaining: a request spent is not given back", d.Requests.Remaining)
	}
}

// tokens_per_minute: a request is reserved its prompt estimate and its own cap; one that does
// not fit in what remains is 429 tenant_rate_limit_exceeded; End settles the lease with the
// engine's usage (the rest given back), and the tokens charged are those of the usage.
func TestAdmitTokensPerMinute(t *testing.T) {
	f := tenantFleet(t, tenantsOf(keyedTenant("a", func(c *config.Tenant) { c.Limits = limits(0, 1000, 0) })), 1024)
	rule := f.ruleOf(t, "a", "")
	body := `{"model":"m","messages":[{"role":"user","content":"hi"}],"max_tokens":300}`
	first := f.admitAs(t, "key-a", "/v1/chat/completions", body, "", "")
	reserved := estimate(body) + 300
	if !first.ok || first.a.Limits.Tokens.Limit != 1000 || first.a.Limits.Tokens.Remaining != 1000-reserved || first.a.Limits.Requests.Limit != 0 {
		t.Fatalf("admitted %v, limits %+v; want %d tokens remaining", first.ok, first.a.Limits, 1000-reserved)
	}
	if string(first.preq.Body) != body {
		t.Errorf("a request with its cap was rewritten: %s", first.preq.Body)
	}
	big := `{"model":"m","messages":[{"role":"user","content":"hi"}],"max_tokens":800}`
	x := f.admitAs(t, "key-a", "/v1/chat/completions", big, "", "")
	x.a.End()
	if e := x.a.Refusal; x.ok || e.Status != http.StatusTooManyRequests || e.Code != openai.CodeTenantRateLimit || e.RetryAfter == "" ||
		!strings.Contains(e.Message, "1000 tokens per minute") || !strings.Contains(e.Message, strconv.Itoa(estimate(big)+800)) {
		t.Fatalf("a request past what remains: %+v", e)
	}
	// What remains refills a token per 60 ms meanwhile.
	if l := x.a.Limits.Tokens; l.Limit != 1000 || l.Remaining < 1000-reserved || l.Remaining > 1000-reserved+5 {
		t.Errorf("refused: limits %+v", x.a.Limits)
	}
	if n := testutil.ToFloat64(f.m.TenantRejections.WithLabelValues("a", tenant.ReasonTokens)); n != 1 {
		t.Errorf("%v rejections for tokens counted", n)
	}
	// The engine answered with its usage: 10 + 50 tokens charged, the rest of the reservation
	// given back.
	first.rec.UsageKnown, first.rec.AnswerComputed = true, true
	first.rec.Usage.Prompt, first.rec.Usage.Completion = 10, 50
	first.a.End()
	if c := f.d.Tenancy().Limiter.Charged(rule.ID); c != 60 {
		t.Errorf("charged %d tokens, want the usage's 60", c)
	}
	if d := f.peek(t, rule); d.Tokens.Remaining < 940 || d.Tokens.Remaining > 950 {
		t.Errorf("%d tokens remain after settling 60 of 1000 (the rest given back)", d.Tokens.Remaining)
	}
	first.a.End() // settling twice changes nothing
	if c := f.d.Tenancy().Limiter.Charged(rule.ID); c != 60 {
		t.Errorf("a second End charged again: %d", c)
	}
}

// A request ended without an engine given it is charged nothing: its reservation goes back
// whole.
func TestAdmitEndChargesNothingUndispatched(t *testing.T) {
	f := tenantFleet(t, tenantsOf(keyedTenant("a", func(c *config.Tenant) { c.Limits = limits(0, 1000, 0) })), 1024)
	rule := f.ruleOf(t, "a", "")
	x := f.admitAs(t, "key-a", "/v1/chat/completions", `{"model":"m","messages":[],"max_tokens":500}`, "", "")
	if !x.ok || x.a.Limits.Tokens.Remaining > 500 {
		t.Fatalf("admitted %v, limits %+v", x.ok, x.a.Limits)
	}
	x.a.End()
	if c := f.d.Tenancy().Limiter.Charged(rule.ID); c != 0 {
		t.Errorf("charged %d for a request no engine was given", c)
	}
	if d := f.peek(t, rule); d.Tokens.Remaining != 1000 {
		t.Errorf("%d tokens remain, want the whole bucket back", d.Tokens.Remaining)
	}
}

// A prompt the engines' tokenizer counted already (PromptTokens) is reserved at that count and
// settled at once; one estimated from its bytes is settled once the worker that computed it
// counted it (CountPrompt, asked with the record's worker and model).
func TestAdmitPromptCounts(t *testing.T) {
	cfg := tenantsOf(keyedTenant("a", func(c *config.Tenant) { c.Limits = limits(0, 1000, 0) }))
	var mu sync.Mutex
	var asked []string
	count := func(_ context.Context, workerURL, model, path string, _ []byte) (int, bool) {
		mu.Lock()
		defer mu.Unlock()
		asked = append(asked, workerURL+" "+model+" "+path)
		return 7, true
	}
	cached := tenantFleet(t, cfg, 1024, func(o *Options) {
		o.Tenancy.PromptTokens = func(model, path string, _ []byte) (int, bool) { return 5, model == "m" && path == "/v1/completions" }
		o.Tenancy.CountPrompt = count
	})
	x := cached.admitAs(t, "key-a", "/v1/completions", `{"model":"m","prompt":"hello there","max_tokens":100}`, "", "")
	if !x.ok || x.a.Limits.Tokens.Remaining != 1000-5-100 {
		t.Fatalf("admitted %v, limits %+v; want 5 + 100 reserved", x.ok, x.a.Limits)
	}
	x.rec.AnswerComputed, x.rec.Worker = true, "http://a:8000"
	x.a.End()
	cached.d.Wait()
	if c := cached.d.Tenancy().Limiter.Charged(cached.ruleOf(t, "a", "").ID); c != 105 || len(asked) != 0 {
		t.Errorf("charged %d (want the counted prompt 5 + the completion 100), asked %v", c, asked)
	}

	f := tenantFleet(t, cfg, 1024, func(o *Options) { o.Tenancy.CountPrompt = count })
	body := `{"model":"m","prompt":"hello there","max_tokens":100}`
	x = f.admitAs(t, "key-a", "/v1/completions", body, "", "")
	if !x.ok || x.a.Limits.Tokens.Remaining != 1000-estimate(body)-100 {
		t.Fatalf("admitted %v, limits %+v", x.ok, x.a.Limits)
	}
	x.rec.AnswerComputed, x.rec.Worker, x.rec.Served = true, "http://a:8000", "m-served"
	x.a.End()
	f.d.Wait()
	if c := f.d.Tenancy().Limiter.Charged(f.ruleOf(t, "a", "").ID); c != 107 {
		t.Errorf("charged %d, want the worker's count 7 + the completion 100", c)
	}
	if len(asked) != 1 || asked[0] != "http://a:8000 m-served /v1/completions" {
		t.Errorf("asked %v", asked)
	}
}

// max_concurrent: the limit's requests at once; the next is 429 tenant_concurrency_exceeded
// with Retry-After 1; End frees the slot.
func TestAdmitConcurrency(t *testing.T) {
	f := tenantFleet(t, tenantsOf(keyedTenant("a", func(c *config.Tenant) { c.Limits = limits(0, 0, 1) })), 1024)
	body := `{"model":"m","messages":[]}`
	first := f.admitAs(t, "key-a", "/v1/chat/completions", body, "", "")
	if !first.ok {
		t.Fatalf("refused %+v", first.a.Refusal)
	}
	x := f.admitAs(t, "key-a", "/v1/chat/completions", body, "", "")
	x.a.End()
	if e := x.a.Refusal; x.ok || e.Status != http.StatusTooManyRequests || e.Code != openai.CodeTenantConcurrency || e.RetryAfter != "1" ||
		!strings.Contains(e.Message, "tenant a has 1 requests in flight, its limit (max_concurrent)") {
		t.Fatalf("second at once: %+v", e)
	}
	if d := f.peek(t, f.ruleOf(t, "a", "")); d.InFlight != 1 || d.MaxConc != 1 {
		t.Errorf("in flight %d of %d", d.InFlight, d.MaxConc)
	}
	first.a.End()
	if d := f.peek(t, f.ruleOf(t, "a", "")); d.InFlight != 0 {
		t.Errorf("in flight %d after End", d.InFlight)
	}
	x = f.admitAs(t, "key-a", "/v1/chat/completions", body, "", "")
	if !x.ok {
		t.Errorf("after End: refused %+v", x.a.Refusal)
	}
	x.a.End()
}

// A model's rule holds beside the tenant's: the headers show the model's windows; a request
// refused by the tenant's rule takes nothing from the model's, and one refused by the model's
// rule names the model.
func TestAdmitModelRules(t *testing.T) {
	f := tenantFleet(t, tenantsOf(keyedTenant("a", func(c *config.Tenant) {
		c.Limits = limits(0, 0, 1)
		big := limits(100, 0, 0)
		big.Model = "big"
		sm := limits(0, 0, 1)
		sm.Model = "sm*"
		c.ModelLimits = []config.Limits{*big, *sm}
	})), 1024)
	first := f.admitAs(t, "key-a", "/v1/chat/completions", `{"model":"big","messages":[]}`, "", "")
	if !first.ok || first.a.Limits.Requests.Limit != 100 || first.a.Limits.Requests.Remaining != 99 {
		t.Fatalf("admitted %v, limits %+v: want the model rule's windows", first.ok, first.a.Limits)
	}
	x := f.admitAs(t, "key-a", "/v1/chat/completions", `{"model":"big","messages":[]}`, "", "")
	x.a.End()
	if e := x.a.Refusal; x.ok || e.Code != openai.CodeTenantConcurrency || !strings.Contains(e.Message, "its limit (max_concurrent)") {
		t.Fatalf("past the tenant's max_concurrent: %+v", e)
	}
	if d := f.peek(t, f.ruleOf(t, "a", "big")); d.Requests.Remaining < 99 {
		t.Errorf("the model's rule kept the refused request: %d of 100 remain", d.Requests.Remaining)
	}
	first.a.End()
	// The model rule of sm* refuses a second "small" at once while the tenant's own allows it
	// no more than one either: the first one the model rule refuses names the model.
	one := f.admitAs(t, "key-a", "/v1/chat/completions", `{"model":"small","messages":[]}`, "", "")
	if !one.ok {
		t.Fatalf("small: %+v", one.a.Refusal)
	}
	x = f.admitAs(t, "key-a", "/v1/chat/completions", `{"model":"small","messages":[]}`, "", "")
	x.a.End()
	if e := x.a.Refusal; x.ok || e.Code != openai.CodeTenantConcurrency || !strings.Contains(e.Message, "its limit for sm*") {
		t.Errorf("past the model's max_concurrent: %+v", e)
	}
	one.a.End()
	if d := f.peek(t, f.ruleOf(t, "a", "")); d.InFlight != 0 {
		t.Errorf("the tenant's rule holds %d in flight after every End", d.InFlight)
	}
}

// A request that could not fit in the tenant's whole bucket is refused at once: 429
// tenant_request_too_large naming its cap, never retryable, no Retry-After; nothing reserved.
func TestAdmitRequestTooLarge(t *testing.T) {
	f := tenantFleet(t, tenantsOf(keyedTenant("a", func(c *config.Tenant) { c.Limits = limits(0, 1000, 0) })), 1024)
	long := strings.Repeat("word ", 600) // about 750 tokens by its bytes
	for _, c := range []struct {
		path, body, param, says string
	}{
		{"/v1/chat/completions", `{"model":"m","messages":[],"max_tokens":2000}`, "max_tokens", "max_tokens 2000 (× 1 prompts and samples)"},
		{"/v1/chat/completions", `{"model":"m","messages":[],"max_completion_tokens":600,"n":2}`, "max_completion_tokens", "(× 2 prompts and samples)"},
		{"/v1/completions", `{"model":"m","prompt":["a","b","c"],"max_tokens":400}`, "max_tokens", "(× 3 prompts and samples)"},
		{"/v1/completions", `{"model":"m","prompt":"a","max_tokens":400,"best_of":3}`, "max_tokens", "(× 3 prompts and samples)"},
		{"/v1/responses", `{"model":"m","input":"a","max_output_tokens":1001}`, "max_output_tokens", "max_output_tokens 1001"},
		{"/generate", `{"model":"m","text":"a","sampling_params":{"max_new_tokens":1500}}`, "sampling_params.max_new_tokens", "sampling_params.max_new_tokens 1500"},
		{"/generate", `{"model":"m","text":"a","sampling_params":[{"max_new_tokens":10},{"max_new_tokens":1200}]}`, "sampling_params.max_new_tokens", "1200"},
		{"/v1/chat/completions", `{"model":"m","messages":[{"role":"user","content":"` + long + `"}],"max_tokens":400}`, "max_tokens", "shorten the prompt"},
	} {
		x := f.admitAs(t, "key-a", c.path, c.body, "", "")
		x.a.End()
		e := x.a.Refusal
		if x.ok || e.Status != http.StatusTooManyRequests || e.Code != openai.CodeTenantRequestTooLarge || e.Param != c.param ||
			!e.NoRetry || e.RetryAfter != "" || !strings.Contains(e.Message, c.says) || !strings.Contains(e.Message, "1000 tokens per minute") {
			t.Errorf("%s %.90s: %+v", c.path, c.body, e)
		}
	}
	if n := testutil.ToFloat64(f.m.TenantRejections.WithLabelValues("a", tenant.ReasonTokens)); n != 8 {
		t.Errorf("%v rejections for tokens counted, want 8", n)
	}
	if d := f.peek(t, f.ruleOf(t, "a", "")); d.Tokens.Remaining != 1000 {
		t.Errorf("refused requests took tokens: %d remain", d.Tokens.Remaining)
	}
}

// A request naming no cap gets the route's default written into its body (every other member
// as it was), no more than the bucket holds beside its prompt; /v1/messages requires max_tokens,
// and a list of SGLang sampling_params needs one in each.
func TestAdmitWritesTheDefaultCap(t *testing.T) {
	f := tenantFleet(t, tenantsOf(
		keyedTenant("a", func(c *config.Tenant) { c.Limits = limits(0, 100000, 0) }),
		keyedTenant("small", func(c *config.Tenant) { c.Limits = limits(0, 200, 0) }),
	), 1024)
	for _, c := range []struct {
		tenant, path, body string
		member             string // the member written, "" for sampling_params.max_new_tokens
		want               int
	}{
		{"a", "/v1/chat/completions", `{"model":"m","messages":[{"role":"user","content":"hi"}]}`, "max_tokens", 1024},
		{"a", "/v1/chat/completions", `{"model":"m","messages":[],"max_tokens":null}`, "max_tokens", 1024},
		{"a", "/v1/completions", `{"model":"m","prompt":"hi"}`, "max_tokens", 16},
		{"a", "/v1/responses", `{"model":"m","input":"hi"}`, "max_output_tokens", 1024},
		{"a", "/generate", `{"model":"m","text":"hi"}`, "", 128},
		{"a", "/generate", `{"model":"m","text":"hi","sampling_params":{"temperature":0}}`, "", 128},
		{"a", "/generate", `{"model":"m","text":"hi","sampling_params":null}`, "", 128},
		{"small", "/v1/chat/completions", `{"model":"m","messages":[{"role":"user","content":"hi"}]}`, "max_tokens", 200 - estimate(`{"model":"m","messages":[{"role":"user","content":"hi"}]}`)},
	} {
		x := f.admitAs(t, "key-"+c.tenant, c.path, c.body, "", "")
		x.a.End()
		if !x.ok {
			t.Errorf("%s %s: refused %+v", c.path, c.body, x.a.Refusal)
			continue
		}
		var got, orig map[string]json.RawMessage
		if err := json.Unmarshal(x.preq.Body, &got); err != nil {
			t.Fatal(err)
		}
		_ = json.Unmarshal([]byte(c.body), &orig)
		v := got[c.member]
		if c.member == "" {
			var sp map[string]json.RawMessage
			_ = json.Unmarshal(got["sampling_params"], &sp)
			v = sp["max_new_tokens"]
			if was, _ := openai.Get([]byte(c.body), "sampling_params"); strings.Contains(string(was), "temperature") && string(sp["temperature"]) != "0" {
				t.Errorf("%s: sampling_params lost its temperature: %s", c.body, got["sampling_params"])
			}
			delete(got, "sampling_params")
			delete(orig, "sampling_params")
		} else {
			delete(got, c.member)
			delete(orig, c.member)
		}
		if string(v) != strconv.Itoa(c.want) {
			t.Errorf("%s %s: cap written %s, want %d (body %s)", c.path, c.body, v, c.want, x.preq.Body)
		}
		for k, ov := range orig {
			if string(got[k]) != string(ov) {
				t.Errorf("%s %s: %s became %s", c.path, c.body, k, got[k])
			}
		}
		if len(got) != len(orig) {
			t.Errorf("%s %s: members %v", c.path, c.body, got)
		}
	}
	for _, c := range []struct{ path, body, param string }{
		{"/v1/messages", `{"model":"m","messages":[]}`, "max_tokens"},
		{"/generate", `{"model":"m","text":["a","b"],"sampling_params":[{"max_new_tokens":5},{"temperature":0}]}`, "sampling_params[1].max_new_tokens"},
		{"/generate", `{"model":"m","text":["a"],"sampling_params":[{"max_new_tokens":null}]}`, "sampling_params[0].max_new_tokens"},
	} {
		x := f.admitAs(t, "key-a", c.path, c.body, "", "")
		x.a.End()
		if e := x.a.Refusal; x.ok || e.Status != http.StatusBadRequest || e.Code != openai.CodeInvalidRequest || e.Param != c.param ||
			!strings.Contains(e.Message, "is required on "+c.path) {
			t.Errorf("%s %s: %+v", c.path, c.body, e)
		}
	}
}

// Caps and counts Baton cannot read as it reserves them are refused 400 invalid_request naming
// them: another letter case than the engines' field, a value that is no non-negative integer.
func TestAdmitRefusesUnreadableCaps(t *testing.T) {
	f := tenantFleet(t, tenantsOf(keyedTenant("a", func(c *config.Tenant) { c.Limits = limits(0, 100000, 0) })), 1024)
	for _, c := range []struct{ path, body, param, says string }{
		{"/v1/chat/completions", `{"model":"m","messages":[],"MAX_TOKENS":5}`, "MAX_TOKENS", "another letter case"},
		{"/v1/chat/completions", `{"model":"m","messages":[],"max_tokens":10,"Max_Completion_Tokens":100000}`, "Max_Completion_Tokens", "another letter case"},
		{"/v1/completions", `{"model":"m","prompt":"x","Best_Of":10}`, "Best_Of", "another letter case"},
		{"/generate", `{"model":"m","text":"x","sampling_params":{"Max_New_Tokens":99999}}`, "sampling_params.Max_New_Tokens", "another letter case"},
		{"/generate", `{"model":"m","text":"x","sampling_params":{"N":3}}`, "sampling_params.N", "another letter case"},
		{"/v1/chat/completions", `{"model":"m","messages":[],"max_tokens":"1e5"}`, "max_tokens", "non-negative integer"},
		{"/v1/chat/completions", `{"model":"m","messages":[],"max_tokens":"-5"}`, "max_tokens", "non-negative integer"},
		{"/v1/chat/completions", `{"model":"m","messages":[],"max_tokens":10.5}`, "max_tokens", "non-negative integer"},
		{"/v1/chat/completions", `{"model":"m","messages":[],"max_completion_tokens":-1}`, "max_completion_tokens", "non-negative integer"},
		{"/v1/completions", `{"model":"m","prompt":"x","max_tokens":5,"best_of":"10"}`, "best_of", "non-negative integer"},
		{"/generate", `{"model":"m","text":"x","sampling_params":{"max_new_tokens":5,"n":"2"}}`, "sampling_params.n", "non-negative integer"},
		{"/generate", `{"model":"m","text":"x","sampling_params":{"max_new_tokens":"5"}}`, "sampling_params.max_new_tokens", "non-negative integer"},
		{"/generate", `{"model":"m","text":["x"],"sampling_params":[{"max_new_tokens":5,"n":2.5}]}`, "sampling_params[0].n", "non-negative integer"},
		{"/generate", `{"model":"m","text":["x"],"sampling_params":[{"max_new_tokens":"5"}]}`, "sampling_params[0].max_new_tokens", "non-negative integer"},
	} {
		x := f.admitAs(t, "key-a", c.path, c.body, "", "")
		x.a.End()
		if e := x.a.Refusal; x.ok || e.Status != http.StatusBadRequest || e.Code != openai.CodeInvalidRequest || e.Param != c.param ||
			!strings.HasPrefix(e.Message, c.param+" ") || !strings.Contains(e.Message, c.says) {
			t.Errorf("%s %s: %+v", c.path, c.body, e)
		}
	}
	if d := f.peek(t, f.ruleOf(t, "a", "")); d.Tokens.Remaining != 100000 {
		t.Errorf("refused requests took tokens: %d remain", d.Tokens.Remaining)
	}
	// A malformed request is no rejection by the tenant's limit: the operator's rejection count
	// (and its alerts) stays on requests the limit refused.
	if n := testutil.CollectAndCount(f.m.TenantRejections); n != 0 {
		t.Errorf("%d rejection series counted for malformed requests", n)
	}
}

// The completion reserved is the cap times the prompts and samples: best_of, n, a batch of
// prompts, SGLang's sampling_params.n, and the largest of a list of sampling_params.
func TestAdmitReservesPromptsAndSamples(t *testing.T) {
	f := tenantFleet(t, tenantsOf(keyedTenant("a", func(c *config.Tenant) { c.Limits = limits(0, 100000, 0) })), 1024)
	for _, c := range []struct {
		path, body string
		completion int
	}{
		{"/v1/completions", `{"model":"m","prompt":"x","max_tokens":100,"best_of":3}`, 300},
		{"/v1/completions", `{"model":"m","prompt":"x","max_tokens":100,"n":2,"best_of":1}`, 200},
		{"/v1/completions", `{"model":"m","prompt":["x","y"],"max_tokens":100,"n":2}`, 400},
		{"/v1/chat/completions", `{"model":"m","messages":[],"max_tokens":10,"max_completion_tokens":70}`, 70},
		{"/generate", `{"model":"m","text":["a","b"],"sampling_params":{"max_new_tokens":50,"n":3}}`, 300},
		{"/generate", `{"model":"m","text":["a","b"],"sampling_params":[{"max_new_tokens":50},{"max_new_tokens":80,"n":2}]}`, 320},
	} {
		x := f.admitAs(t, "key-a", c.path, c.body, "", "")
		if !x.ok {
			t.Errorf("%s %s: refused %+v", c.path, c.body, x.a.Refusal)
			continue
		}
		want := 100000 - estimate(c.body) - c.completion
		if got := x.a.Limits.Tokens.Remaining; got != want {
			t.Errorf("%s %s: %d tokens remain, want %d (completion %d reserved)", c.path, c.body, got, want, c.completion)
		}
		if string(x.preq.Body) != c.body {
			t.Errorf("%s: a request with its caps was rewritten: %s", c.path, x.preq.Body)
		}
		x.a.End() // nothing computed: all given back
	}
}

// A tenant's stream is charged by its events; under a token limit one that asks no usage is
// made to (stream_options.include_usage), the relay told to keep the usage event from it.
func TestAdmitStreamsAskUsage(t *testing.T) {
	f := tenantFleet(t, tenantsOf(
		keyedTenant("a", func(c *config.Tenant) { c.Limits = limits(0, 100000, 0) }),
		keyedTenant("r", func(c *config.Tenant) { c.Limits = limits(100, 0, 0) }),
	), 1024)
	for _, c := range []struct {
		key, path, body string
		orders          proxy.Orders
		options         string // the body's stream_options after, "-" for none
	}{
		{"key-a", "/v1/chat/completions", `{"model":"m","messages":[],"max_tokens":5,"stream":true}`, proxy.Orders{CountUsage: true, StripUsage: true, AskedEach: true},
			`{"include_usage":true,"continuous_usage_stats":true}`},
		{"key-a", "/v1/completions", `{"model":"m","prompt":"x","max_tokens":5,"stream":true,"stream_options":{"continuous_usage_stats":true}}`,
			proxy.Orders{CountUsage: true, StripUsage: true, ClientEach: true}, `{"continuous_usage_stats":true,"include_usage":true}`},
		{"key-a", "/v1/chat/completions", `{"model":"m","messages":[],"max_tokens":5,"stream":true,"stream_options":{"include_usage":false}}`,
			proxy.Orders{CountUsage: true, StripUsage: true, AskedEach: true}, `{"include_usage":true,"continuous_usage_stats":true}`},
		{"key-a", "/v1/chat/completions", `{"model":"m","messages":[],"max_tokens":5,"stream":true,"stream_options":{"include_usage":true}}`,
			proxy.Orders{CountUsage: true, AskedEach: true}, `{"include_usage":true,"continuous_usage_stats":true}`},
		{"key-a", "/v1/chat/completions", `{"model":"m","messages":[],"max_tokens":5,"stream":true,"stream_options":{"include_usage":true,"continuous_usage_stats":true}}`,
			proxy.Orders{CountUsage: true}, `{"include_usage":true,"continuous_usage_stats":true}`},
		{"key-a", "/v1/messages", `{"model":"m","messages":[],"max_tokens":5,"stream":true}`, proxy.Orders{CountUsage: true}, "-"},
		{"key-a", "/v1/chat/completions", `{"model":"m","messages":[],"max_tokens":5}`, proxy.Orders{}, "-"},
		{"key-r", "/v1/chat/completions", `{"model":"m","messages":[],"stream":true}`, proxy.Orders{CountUsage: true}, "-"},
	} {
		x := f.admitAs(t, c.key, c.path, c.body, "", "")
		x.a.End()
		if !x.ok {
			t.Errorf("%s %s: refused %+v", c.path, c.body, x.a.Refusal)
			continue
		}
		opts := "-"
		if v, ok := x.preq.Get("stream_options"); ok {
			opts = string(v)
		}
		if x.a.Orders != c.orders || x.rec.ByStreamUsage != c.orders.CountUsage || opts != c.options {
			t.Errorf("%s %s: orders %+v, by stream usage %v, stream_options %s; want %+v, %s", c.path, c.body, x.a.Orders, x.rec.ByStreamUsage, opts, c.orders, c.options)
		}
	}
}

// The priority headers name the class, clamped to the tenant's max_priority; an unknown
// X-Baton-Priority is 400, an unknown X-Smg-Priority the default class.
func TestAdmitPriority(t *testing.T) {
	f := tenantFleet(t, tenantsOf(
		keyedTenant("a"),
		keyedTenant("vip", func(c *config.Tenant) { c.MaxPriority = config.PriorityCritical }),
		keyedTenant("bulk", func(c *config.Tenant) { c.MaxPriority = config.PriorityBatch }),
	), 1024)
	body := `{"model":"m","messages":[]}`
	for _, c := range []struct{ key, baton, smg, class string }{
		{"key-a", "", "", "default"},
		{"key-a", "critical", "", "interactive"}, // max_priority interactive by default
		{"key-a", "batch", "", "batch"},
		{"key-a", "", "bulk", "batch"},
		{"key-a", "", "weird", "default"},
		{"key-vip", "Critical", "", "critical"},
		{"key-vip", "", "system", "critical"},
		{"key-bulk", "interactive", "", "batch"},
		{"key-bulk", "", "", "batch"},
	} {
		x := f.admitAs(t, c.key, "/v1/chat/completions", body, c.baton, c.smg)
		x.a.End()
		if !x.ok || string(x.rec.Class) != c.class || string(x.a.Class) != c.class {
			t.Errorf("%s with %q/%q: admitted %v, class %q (record %q), want %q", c.key, c.baton, c.smg, x.ok, x.a.Class, x.rec.Class, c.class)
		}
	}
	x := f.admitAs(t, "key-a", "/v1/chat/completions", body, "urgent", "batch")
	x.a.End()
	if e := x.a.Refusal; x.ok || e.Status != http.StatusBadRequest || e.Code != openai.CodeInvalidPriority || e.Param != openai.HeaderPriority || x.a.Class != "" {
		t.Errorf("unknown X-Baton-Priority: class %q, %+v", x.a.Class, e)
	}
	// An open fleet: every request is tenant default's, held to its ceiling.
	open := newFleet(t, []*worker.Worker{regular("http://a:8000", "m")})
	x = open.admitAs(t, "", "/v1/chat/completions", body, "critical", "")
	x.a.End()
	if !x.ok || x.rec.Class != "interactive" || x.rec.Who != nil {
		t.Errorf("open fleet: admitted %v, class %q, tenant %v", x.ok, x.rec.Class, x.rec.Who)
	}
}

// CountBatch's refusals end the admission before anything is reserved: too many prompts, too
// many samples (n, best_of, sampling_params.n); the model's count in flight ends with End.
func TestAdmitBatchRefusals(t *testing.T) {
	f := tenantFleet(t, tenantsOf(keyedTenant("a", func(c *config.Tenant) { c.Limits = limits(10, 100000, 1) })), 1024)
	nine := `["a","b","c","d","e","f","g","h","i"]`
	for _, c := range []struct{ path, body, says string }{
		{"/v1/completions", `{"model":"m","prompt":` + nine + `,"max_tokens":1}`, "more than 8 prompts"},
		{"/generate", `{"model":"m","text":` + nine + `,"sampling_params":{"max_new_tokens":1}}`, "more than 8 prompts"},
		{"/v1/completions", `{"model":"m","prompt":"x","max_tokens":1,"best_of":9}`, "9 samples per prompt"},
		{"/generate", `{"model":"m","text":"x","sampling_params":{"max_new_tokens":1,"n":9}}`, "9 samples per prompt"},
	} {
		x := f.admitAs(t, "key-a", c.path, c.body, "", "")
		if e := x.a.Refusal; x.ok || e.Status != http.StatusBadRequest || e.Code != openai.CodeBatchTooLarge || !strings.Contains(e.Message, c.says) {
			t.Errorf("%s %s: %+v", c.path, c.body, e)
		}
		if n := testutil.ToFloat64(f.m.ModelInFlight.WithLabelValues(x.rec.ModelLabel)); n != 1 {
			t.Errorf("%v in flight before End", n)
		}
		x.a.End()
		if n := testutil.ToFloat64(f.m.ModelInFlight.WithLabelValues(x.rec.ModelLabel)); n != 0 {
			t.Errorf("%v in flight after End", n)
		}
	}
	d := f.peek(t, f.ruleOf(t, "a", ""))
	if d.Requests.Remaining != 10 || d.Tokens.Remaining != 100000 || d.InFlight != 0 {
		t.Errorf("refused batches were reserved: %+v", d)
	}
	// Within the bounds: counted on the request.
	preq := &pd.Request{Request: parsed(t, `{"model":"m","text":["a","b","c"],"sampling_params":{"n":8}}`), Path: "/generate"}
	if e := f.d.CountBatch(preq); e != nil || preq.Batch != 3 || preq.Samples != 8 {
		t.Errorf("counted %d prompts × %d samples, refusal %+v", preq.Batch, preq.Samples, e)
	}
}

// Admit's last step is the queue: a slot held keeps the next request of a full queue out
// (503 queue_full, nothing of its tenant's kept), and End gives the slot back.
func TestAdmitQueue(t *testing.T) {
	f := tenantFleet(t, tenantsOf(keyedTenant("a", func(c *config.Tenant) { c.Limits = limits(0, 0, 5) })), 1024, func(o *Options) {
		o.Admission = config.Admission{MaxConcurrentRequests: 1, QueueSize: 0, QueueTimeout: time.Minute}
	})
	body := `{"model":"m","messages":[]}`
	first := f.admitAs(t, "key-a", "/v1/chat/completions", body, "", "")
	if !first.ok {
		t.Fatalf("refused %+v", first.a.Refusal)
	}
	if q := f.d.Queues(); q["slots"] != 1 || q["in_use"] != 1 {
		t.Errorf("queues %v", q)
	}
	x := f.admitAs(t, "key-a", "/v1/chat/completions", body, "", "")
	if e := x.a.Refusal; x.ok || e.Status != http.StatusServiceUnavailable || e.Code != openai.CodeQueueFull || e.RetryAfter == "" {
		t.Errorf("a full fleet's next request: %+v", e)
	}
	x.a.End()
	if d := f.peek(t, f.ruleOf(t, "a", "")); d.InFlight != 1 {
		t.Errorf("the tenant holds %d in flight: a request the queue refused kept its reservation", d.InFlight)
	}
	first.a.End()
	if q := f.d.Queues(); q["in_use"] != 0 {
		t.Errorf("after End: queues %v", q)
	}
	release, refusal, ok := f.d.Acquire(context.Background(), &record.Record{})
	if !ok || refusal != nil {
		t.Fatalf("Acquire after End: %+v", refusal)
	}
	release()
	if open := newFleet(t, nil); open.d.Queues() != nil {
		t.Error("an unbounded fleet shows queues")
	}
}

// Identify: Authorization names a keyed tenant (any case of "Bearer"); no key, a wrong key or
// another scheme is 401, two headers 400; an open fleet of one unbounded tenant names nobody.
func TestIdentify(t *testing.T) {
	f := tenantFleet(t, tenantsOf(keyedTenant("a"), keyedTenant("b", func(c *config.Tenant) { c.Limits = limits(5, 0, 0) })), 1024)
	for _, c := range []struct {
		auth []string
		who  string
	}{
		{[]string{"Bearer key-a"}, "a"},
		{[]string{"bearer key-b"}, "b"},
		{[]string{"BEARER key-a"}, "a"},
	} {
		who, key, e := f.d.Identify(c.auth, nil)
		if e != nil || who == nil || who.Name != c.who || !key {
			t.Errorf("%v: %v, key %v, %+v", c.auth, who, key, e)
		}
	}
	for _, c := range []struct {
		auth   []string
		status int
		code   string
	}{
		{nil, http.StatusUnauthorized, openai.CodeInvalidAPIKey},
		{[]string{"Bearer key-c"}, http.StatusUnauthorized, openai.CodeInvalidAPIKey},
		{[]string{"Bearer "}, http.StatusUnauthorized, openai.CodeInvalidAPIKey},
		{[]string{"key-a"}, http.StatusUnauthorized, openai.CodeInvalidAPIKey},
		{[]string{"Basic key-a"}, http.StatusUnauthorized, openai.CodeInvalidAPIKey},
		{[]string{"Bearer key-a", "Bearer key-b"}, http.StatusBadRequest, openai.CodeDuplicateHeader},
	} {
		who, key, e := f.d.Identify(c.auth, []string{"a"}) // the trusted header is not read: tenants have keys
		if who != nil || key || e == nil || e.Status != c.status || e.Code != c.code {
			t.Errorf("%v: %v, key %v, %+v", c.auth, who, key, e)
		}
	}
	// Open fleets: one unbounded tenant is nobody; a limited default is named, without a key.
	open := newFleet(t, nil)
	if who, key, e := open.d.Identify([]string{"Bearer anything"}, nil); who != nil || key || e != nil {
		t.Errorf("open fleet: %v, key %v, %+v", who, key, e)
	}
	limited := tenantFleet(t, tenantsOf(config.Tenant{Name: "default", Limits: limits(5, 0, 0)}), 1024)
	if who, key, e := limited.d.Identify(nil, nil); e != nil || who == nil || who.Name != "default" || key {
		t.Errorf("open fleet with a limited default: %v, key %v, %+v", who, key, e)
	}
	held := tenantFleet(t, tenantsOf(config.Tenant{Name: "default", Models: []string{"m"}}), 1024)
	if who, _, e := held.d.Identify(nil, nil); e != nil || who == nil || who.Name != "default" {
		t.Errorf("open fleet with a default held to models: %v, %+v", who, e)
	}
}

// The trusted tenant header names a tenant of a fleet whose tenants have no keys: one value, a
// configured name; anything else is 401. Without it the request is tenant default's.
func TestIdentifyTrustedHeader(t *testing.T) {
	cfg := tenantsOf(config.Tenant{Name: "team-a"}, config.Tenant{Name: "team-b", Limits: limits(5, 0, 0)})
	cfg.TrustTenantHeader = true
	f := tenantFleet(t, cfg, 1024, func(o *Options) { o.Tenancy.TrustHeader = "X-Smg-Tenant-Id" })
	for _, name := range []string{"team-a", "team-b"} {
		who, key, e := f.d.Identify(nil, []string{name})
		if e != nil || who == nil || who.Name != name || !key {
			t.Errorf("%s: %v, key %v, %+v", name, who, key, e)
		}
	}
	for _, trusted := range [][]string{{"team-c"}, {""}, {"team-a", "team-b"}} {
		who, key, e := f.d.Identify(nil, trusted)
		if who != nil || key || e == nil || e.Status != http.StatusUnauthorized || e.Code != openai.CodeInvalidAPIKey ||
			!strings.Contains(e.Message, "X-Smg-Tenant-Id") {
			t.Errorf("%q: %v, key %v, %+v", trusted, who, key, e)
		}
	}
	if who, _, e := f.d.Identify(nil, nil); who != nil || e != nil {
		t.Errorf("no header: %v, %+v (want the unbounded default: nobody)", who, e)
	}
	if who, _, e := f.d.Identify([]string{"Bearer a", "Bearer b"}, []string{"team-a"}); who != nil || e == nil || e.Code != openai.CodeDuplicateHeader {
		t.Errorf("two Authorization headers beside the trusted one: %v, %+v", who, e)
	}
}

// The default tenancy: --api-key names tenant default, nothing is limited, 1024 tokens reserved
// for a request without a cap; without a key everyone is tenant default, unbounded.
func TestDefaultTenancy(t *testing.T) {
	ten := DefaultTenancy("sk-1")
	if ten.Limiter == nil || ten.MaxTokens != 1024 || ten.Set == nil || ten.TrustHeader != "" {
		t.Fatalf("%+v", ten)
	}
	f := newFleet(t, nil, func(o *Options) { o.APIKey = "sk-1" })
	who, key, e := f.d.Identify([]string{"Bearer sk-1"}, nil)
	if e != nil || who == nil || who.Name != config.DefaultTenant || !key || len(who.Rules()) != 0 || len(who.Models()) != 0 {
		t.Errorf("--api-key: %v, key %v, %+v", who, key, e)
	}
	if _, _, e := f.d.Identify([]string{"Bearer sk-2"}, nil); e == nil || e.Status != http.StatusUnauthorized {
		t.Errorf("another key: %+v", e)
	}
	if _, _, e := f.d.Identify(nil, nil); e == nil || e.Status != http.StatusUnauthorized {
		t.Errorf("no key: %+v", e)
	}
	set := DefaultTenancy("").Set()
	if !set.Open() || len(set.Tenants()) != 1 || set.Tenants()[0].Name != config.DefaultTenant {
		t.Errorf("without a key: open %v, tenants %v", set.Open(), set.Names())
	}
}

// OpenAI's rate-limit headers: the three of each limit the rule has, canonical names, resets
// spelled as OpenAI does; none without limits.
func TestRateLimitHeaders(t *testing.T) {
	h := map[string][]string{"Other": {"x"}}
	RateLimitHeaders(h, tenant.Decision{})
	if len(h) != 1 {
		t.Errorf("no limits: %v", h)
	}
	RateLimitHeaders(h, tenant.Decision{Requests: tenant.Window{Limit: 600, Remaining: 599, Reset: 100 * time.Millisecond}})
	want := map[string]string{"Other": "x", "X-Ratelimit-Limit-Requests": "600", "X-Ratelimit-Remaining-Requests": "599", "X-Ratelimit-Reset-Requests": "100ms"}
	if !sameHeaders(h, want) {
		t.Errorf("requests: %v", h)
	}
	h = http.Header{}
	RateLimitHeaders(h, tenant.Decision{Requests: tenant.Window{Limit: 10, Remaining: 0, Reset: 6 * time.Minute},
		Tokens: tenant.Window{Limit: 200000, Remaining: 150000, Reset: 1500 * time.Millisecond}})
	want = map[string]string{"X-Ratelimit-Limit-Requests": "10", "X-Ratelimit-Remaining-Requests": "0", "X-Ratelimit-Reset-Requests": "6m0s",
		"X-Ratelimit-Limit-Tokens": "200000", "X-Ratelimit-Remaining-Tokens": "150000", "X-Ratelimit-Reset-Tokens": "2s"}
	if !sameHeaders(h, want) || http.Header(h).Get("x-ratelimit-remaining-tokens") != "150000" {
		t.Errorf("both: %v", h)
	}
	h = http.Header{}
	RateLimitHeaders(h, tenant.Decision{Tokens: tenant.Window{Limit: 1000, Remaining: 1000}})
	want = map[string]string{"X-Ratelimit-Limit-Tokens": "1000", "X-Ratelimit-Remaining-Tokens": "1000", "X-Ratelimit-Reset-Tokens": "0ms"}
	if !sameHeaders(h, want) {
		t.Errorf("tokens: %v", h)
	}
}

// sameHeaders reports whether h holds exactly want, one value each.
func sameHeaders(h map[string][]string, want map[string]string) bool {
	if len(h) != len(want) {
		return false
	}
	for k, v := range want {
		if len(h[k]) != 1 || h[k][0] != v {
			return false
		}
	}
	return true
}

func TestResetString(t *testing.T) {
	for _, c := range []struct {
		d    time.Duration
		want string
	}{
		{0, "0ms"}, {-time.Second, "0ms"}, {120 * time.Millisecond, "120ms"}, {999 * time.Millisecond, "999ms"},
		{time.Second, "1s"}, {1499 * time.Millisecond, "1s"}, {1500 * time.Millisecond, "2s"},
		{90 * time.Second, "1m30s"}, {6 * time.Minute, "6m0s"},
	} {
		if got := ResetString(c.d); got != c.want {
			t.Errorf("%v: %q, want %q", c.d, got, c.want)
		}
	}
}

func TestCompletionBudget(t *testing.T) {
	for _, c := range []struct {
		path, body string
		want       budgetOf
	}{
		{"/v1/chat/completions", `{}`, budgetOf{tokens: 500, field: "max_tokens", missing: true, toContext: true}},
		{"/v1/chat/completions", `{"max_tokens":null}`, budgetOf{tokens: 500, field: "max_tokens", missing: true, toContext: true}},
		{"/v1/chat/completions", `{"max_tokens":10,"max_completion_tokens":20}`, budgetOf{tokens: 20, field: "max_completion_tokens"}},
		{"/v1/chat/completions", `{"max_tokens":30,"max_completion_tokens":20}`, budgetOf{tokens: 30, field: "max_tokens"}},
		{"/v1/chat/completions", `{"max_tokens":0}`, budgetOf{tokens: 0, field: "max_tokens"}},
		{"/v1/chat/completions", `{"max_tokens":10,"max_completion_tokens":"20"}`, budgetOf{tokens: 20, field: "max_completion_tokens"}},
		{"/v1/chat/completions", `{"max_tokens":10,"max_completion_tokens":20.0}`, budgetOf{tokens: 20, field: "max_completion_tokens"}},
		{"/v1/chat/completions", `{"max_tokens":10,"max_completion_tokens":"2.0"}`, budgetOf{field: "max_completion_tokens", invalid: true}},
		{"/v1/completions", `{}`, budgetOf{tokens: 16, field: "max_tokens", missing: true}},
		// vLLM reads an explicit null as no cap (get_max_tokens): to the context's end.
		{"/v1/completions", `{"max_tokens":null}`, budgetOf{tokens: 500, field: "max_tokens", missing: true, toContext: true}},
		{"/v1/completions", `{"max_tokens":100000}`, budgetOf{tokens: 100000, field: "max_tokens"}},
		{"/v1/responses", `{}`, budgetOf{tokens: 500, field: "max_output_tokens", missing: true, toContext: true}},
		{"/v1/responses", `{"max_output_tokens":7}`, budgetOf{tokens: 7, field: "max_output_tokens"}},
		{"/v1/messages", `{}`, budgetOf{tokens: 500, field: "max_tokens", missing: true, required: true}},
		{"/v1/messages", `{"max_tokens":64}`, budgetOf{tokens: 64, field: "max_tokens"}},
		{"/v1/embeddings", `{}`, budgetOf{tokens: 500, field: "max_tokens", missing: true}},
		{"/generate", `{}`, budgetOf{tokens: 128, field: "sampling_params.max_new_tokens", missing: true}},
		{"/generate", `{"max_tokens":5}`, budgetOf{tokens: 128, field: "sampling_params.max_new_tokens", missing: true}},
		{"/generate", `{"sampling_params":{"max_new_tokens":50}}`, budgetOf{tokens: 50, field: "sampling_params.max_new_tokens"}},
		{"/generate", `{"sampling_params":{"max_new_tokens":null}}`, budgetOf{tokens: 128, field: "sampling_params.max_new_tokens", missing: true}},
		{"/generate", `{"sampling_params":{"max_new_tokens":"50"}}`, budgetOf{field: "sampling_params.max_new_tokens", invalid: true}},
		{"/generate", `{"sampling_params":[{"max_new_tokens":5},{"max_new_tokens":9}]}`, budgetOf{tokens: 9, field: "sampling_params.max_new_tokens"}},
	} {
		if got := completionBudget(parsed(t, c.body), c.path, 500); got != c.want {
			t.Errorf("%s %s: %+v, want %+v", c.path, c.body, got, c.want)
		}
	}
}

func TestListBudget(t *testing.T) {
	for _, c := range []struct {
		raw  string
		want budgetOf
	}{
		{`[{"max_new_tokens":5},{"max_new_tokens":9,"n":2}]`, budgetOf{tokens: 9, field: "sampling_params.max_new_tokens"}},
		{`[{"max_new_tokens":0}]`, budgetOf{tokens: 0, field: "sampling_params.max_new_tokens"}},
		{`[{"max_new_tokens":5},{}]`, budgetOf{field: "sampling_params[1].max_new_tokens", missing: true, required: true}},
		{`[{"max_new_tokens":null}]`, budgetOf{field: "sampling_params[0].max_new_tokens", missing: true, required: true}},
		{`[{"max_new_tokens":-3}]`, budgetOf{field: "sampling_params[0].max_new_tokens", invalid: true}},
		{`[{"max_new_tokens":5},{"max_new_tokens":1e3}]`, budgetOf{field: "sampling_params[1].max_new_tokens", invalid: true}},
		{`[{"max_new_tokens":5,"n":"2"}]`, budgetOf{field: "sampling_params[0].n", invalid: true}},
		{`[1,2]`, budgetOf{field: "sampling_params", invalid: true}},
		{`[{"max_new_tokens":5}`, budgetOf{field: "sampling_params", invalid: true}},
	} {
		if got := listBudget([]byte(c.raw)); got != c.want {
			t.Errorf("%s: %+v, want %+v", c.raw, got, c.want)
		}
	}
}

func TestCapValue(t *testing.T) {
	for _, c := range []struct {
		raw   string
		n     int
		valid bool
	}{
		{"5", 5, true}, {" 7 ", 7, true}, {"0", 0, true}, {"null", -1, true}, {" null", -1, true},
		{"-1", 0, false}, {"1e5", 0, false}, {"10.5", 0, false}, {`"10"`, 0, false}, {"true", 0, false}, {"", 0, false},
	} {
		n, valid := capValue([]byte(c.raw))
		if valid != c.valid || valid && n != c.n {
			t.Errorf("%q: %d, %v; want %d, %v", c.raw, n, valid, c.n, c.valid)
		}
	}
}

func TestWriteBudget(t *testing.T) {
	for _, c := range []struct {
		path, body string
		b          budgetOf
		want       string // "" for an error
	}{
		{"/v1/chat/completions", `{"model":"m"}`, budgetOf{tokens: 5, field: "max_tokens"}, `{"model":"m","max_tokens":5}`},
		{"/v1/chat/completions", `{"model":"m","max_tokens":null,"x":1}`, budgetOf{tokens: 5, field: "max_tokens"}, `{"model":"m","max_tokens":5,"x":1}`},
		{"/v1/responses", `{"input":"a"}`, budgetOf{tokens: 9, field: "max_output_tokens"}, `{"input":"a","max_output_tokens":9}`},
		{"/generate", `{"text":"a"}`, budgetOf{tokens: 128, field: "sampling_params.max_new_tokens"}, `{"text":"a","sampling_params":{"max_new_tokens":128}}`},
		{"/generate", `{"text":"a","sampling_params":null}`, budgetOf{tokens: 128}, `{"text":"a","sampling_params":{"max_new_tokens":128}}`},
		{"/generate", `{"sampling_params":{"temperature":0.5},"text":"a"}`, budgetOf{tokens: 3}, `{"sampling_params":{"temperature":0.5,"max_new_tokens":3},"text":"a"}`},
		{"/generate", `{"sampling_params":[{"temperature":0.5}],"text":["a"]}`, budgetOf{tokens: 3}, ""},
		{"/generate", `{"sampling_params":"x","text":"a"}`, budgetOf{tokens: 3}, ""},
	} {
		got, err := writeBudget([]byte(c.body), c.path, c.b)
		switch {
		case c.want == "" && err == nil:
			t.Errorf("%s %s: wrote %s, want an error", c.path, c.body, got)
		case c.want != "" && (err != nil || string(got) != c.want):
			t.Errorf("%s %s: %s (%v), want %s", c.path, c.body, got, err, c.want)
		}
	}
}

func TestAskUsage(t *testing.T) {
	for _, c := range []struct {
		body, want string
		each       bool
		ask        usageAsk
	}{
		{`{"stream":true}`, `{"stream":true,"stream_options":{"include_usage":true}}`, false, usageAsk{include: true}},
		{`{"stream":true,"stream_options":null}`, `{"stream":true,"stream_options":{"include_usage":true}}`, false, usageAsk{include: true}},
		{`{"stream_options":{"include_usage":true},"stream":true}`, `{"stream_options":{"include_usage":true},"stream":true}`, false, usageAsk{}},
		{`{"stream_options":{"include_usage": true }}`, `{"stream_options":{"include_usage": true }}`, false, usageAsk{}},
		{`{"stream_options":{"include_usage":false}}`, `{"stream_options":{"include_usage":true}}`, false, usageAsk{include: true}},
		{`{"stream_options":{"continuous_usage_stats":true}}`, `{"stream_options":{"continuous_usage_stats":true,"include_usage":true}}`, false, usageAsk{include: true, clientEach: true}},
		{`{"stream_options":"x"}`, `{"stream_options":"x"}`, false, usageAsk{}},
		{`{"stream":true}`, `{"stream":true,"stream_options":{"include_usage":true,"continuous_usage_stats":true}}`, true, usageAsk{include: true, each: true}},
		{`{"stream_options":{"include_usage":true}}`, `{"stream_options":{"include_usage":true,"continuous_usage_stats":true}}`, true, usageAsk{each: true}},
		{`{"stream_options":{"continuous_usage_stats":false,"include_usage":true}}`, `{"stream_options":{"continuous_usage_stats":true,"include_usage":true}}`, true, usageAsk{each: true}},
		{`{"stream_options":{"include_usage":true,"continuous_usage_stats":true}}`, `{"stream_options":{"include_usage":true,"continuous_usage_stats":true}}`, true, usageAsk{}},
		{`{"stream_options":{"continuous_usage_stats":true}}`, `{"stream_options":{"continuous_usage_stats":true,"include_usage":true}}`, true, usageAsk{include: true, clientEach: true}},
	} {
		got, ask := askUsage([]byte(c.body), c.each)
		if string(got) != c.want || ask != c.ask {
			t.Errorf("%s (each %v): %s, %+v; want %s, %+v", c.body, c.each, got, ask, c.want, c.ask)
		}
	}
}

// GET /tenants: each tenant with its models, weight, ceiling and rules (most specific first),
// what each rule has left and in flight, the tokens charged; never a key or its hash.
func TestTenantViews(t *testing.T) {
	big := limits(5, 0, 0)
	big.Model = "big"
	two := 2.0
	f := tenantFleet(t, tenantsOf(
		keyedTenant("a", func(c *config.Tenant) {
			c.Models, c.Weight, c.MaxPriority = []string{"big", "m"}, &two, config.PriorityCritical
			c.Limits, c.ModelLimits = limits(10, 1000, 2), []config.Limits{*big}
		}),
		keyedTenant("b"),
	), 1024)
	x := f.admitAs(t, "key-a", "/v1/chat/completions", `{"model":"big","messages":[],"max_tokens":100}`, "", "")
	if !x.ok {
		t.Fatalf("refused %+v", x.a.Refusal)
	}
	views, err := f.d.TenantViews(context.Background())
	if err != nil || len(views) != 2 {
		t.Fatalf("%d views, %v", len(views), err)
	}
	a, b := views[0], views[1]
	if a.Name != "a" || a.Weight != 2 || a.MaxPriority != "critical" || strings.Join(a.Models, ",") != "big,m" || len(a.Rules) != 2 {
		t.Fatalf("a: %+v", a)
	}
	model, all := a.Rules[0], a.Rules[1]
	if model.Model != "big" || model.RequestsPerMinute != 5 || model.RequestsRemaining == nil || *model.RequestsRemaining != 4 ||
		model.RequestsReset == "" || model.TokensRemaining != nil || model.InFlight != nil || model.TokensCharged != 0 {
		t.Errorf("a's rule for big: %+v", model)
	}
	if all.Model != "" || all.RequestsPerMinute != 10 || all.TokensPerMinute != 1000 || all.MaxConcurrent != 2 ||
		all.RequestsRemaining == nil || *all.RequestsRemaining != 9 || all.TokensRemaining == nil || *all.TokensRemaining > 900 ||
		all.InFlight == nil || *all.InFlight != 1 {
		t.Errorf("a's own rule: %+v", all)
	}
	if b.Name != "b" || b.Models == nil || len(b.Models) != 0 || b.Rules == nil || len(b.Rules) != 0 || b.Weight != 1 || b.MaxPriority != "interactive" {
		t.Errorf("b: %+v", b)
	}
	x.rec.UsageKnown, x.rec.Usage.Prompt, x.rec.Usage.Completion = true, 20, 10
	x.a.End()
	views, _ = f.d.TenantViews(context.Background())
	if r := views[0].Rules; r[0].TokensCharged != 30 || r[1].TokensCharged != 30 || *r[1].InFlight != 0 {
		t.Errorf("after End: %+v, %+v", r[0], r[1])
	}
	out, err := json.Marshal(views)
	if err != nil {
		t.Fatal(err)
	}
	for _, secret := range []string{"key-a", strings.TrimPrefix(config.HashKey("key-a"), "sha256:")} {
		if strings.Contains(string(out), secret) {
			t.Errorf("GET /tenants shows %q: %s", secret, out)
		}
	}
}
