package gateway

import (
	"crypto/hmac"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"net/http"
	"net/url"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/kvgate/kvgate/scheduler/validate"
	"github.com/kvgate/kvgate/store"
)

// The console's pages (console.go). Each one is a few API calls, made in
// process as the session's key, rendered by a template of console/.

const consolePageSize = 50

func fmtFloat(f float64) string { return strconv.FormatFloat(f, 'f', 1, 64) }

func containsString(s []string, v string) bool { return slices.Contains(s, v) }

func prettyJSON(b json.RawMessage) string {
	if len(b) == 0 {
		return ""
	}
	var v any
	if json.Unmarshal(b, &v) != nil {
		return string(b)
	}
	out, _ := json.MarshalIndent(v, "", "  ")
	return string(out)
}

func (s *Server) consoleFleet(w http.ResponseWriter, r *http.Request, u consoleUser) {
	var f fleetView
	err := s.consoleGet(r, u, "/v1/fleet", &f)
	s.page(w, r, u, "fleet", "Fleet", f, err)
}

type queuesData struct {
	Queues queuesView
}

func (s *Server) consoleQueues(w http.ResponseWriter, r *http.Request, u consoleUser) {
	var d queuesData
	err := s.consoleGet(r, u, "/v1/fleet/queues", &d.Queues)
	s.page(w, r, u, "queues", "Queues", d, err)
}

type jobsData struct {
	Jobs       []jobView
	States     []string
	Selected   []string
	Entity     *entityView
	EntityKey  string
	Batch      string // only this batch's lines
	Tenant     string // an admin's: the tenant read (readScope); "" its own
	Since      string
	Until      string
	NextURL    string
	AllStates  []string
	FilterDesc string
}

// v7Cursor is the keyset cursor that starts a listing at jobs created
// before t: job ids are UUIDv7, whose first 48 bits are the creation's
// Unix milliseconds, and listings run by id, newest first.
func v7Cursor(t time.Time) string {
	ms := uint64(t.UnixMilli())
	return fmt.Sprintf("%08x-%04x-0000-0000-000000000000", ms>>16, ms&0xffff)
}

func parseConsoleTime(v string) (time.Time, bool) {
	for _, layout := range []string{"2006-01-02T15:04", time.RFC3339, time.DateOnly} {
		if t, err := time.Parse(layout, v); err == nil {
			return t, true
		}
	}
	return time.Time{}, false
}

func (s *Server) consoleJobs(w http.ResponseWriter, r *http.Request, u consoleUser) {
	q := r.URL.Query()
	d := jobsData{Selected: q["state"], EntityKey: strings.TrimSpace(q.Get("entity")), Batch: strings.TrimSpace(q.Get("batch")),
		Tenant: strings.TrimSpace(q.Get("tenant")),
		Since:  q.Get("since"), Until: q.Get("until")}
	for _, st := range store.States {
		d.AllStates = append(d.AllStates, string(st))
	}
	var err error
	if d.EntityKey != "" {
		var e entityView
		if err = s.consoleGet(r, u, "/v1/entities/"+url.PathEscape(d.EntityKey), &e); err == nil {
			d.Entity = &e
		}
		s.page(w, r, u, "jobs", "Jobs", d, err)
		return
	}
	api := url.Values{"limit": {strconv.Itoa(consolePageSize)}}
	for _, st := range d.Selected {
		api.Add("state", st)
	}
	if d.Batch != "" {
		api.Set("batch", d.Batch)
	}
	after := q.Get("after")
	if t, ok := parseConsoleTime(d.Until); ok && after == "" {
		after = v7Cursor(t)
	}
	if after != "" {
		api.Set("after", after)
	}
	var pg struct {
		Data       []jobView `json:"data"`
		NextCursor string    `json:"next_cursor"`
	}
	if err = s.consoleGet(r, u, "/v1/jobs?"+api.Encode(), &pg); err == nil {
		d.Jobs = pg.Data
		next := pg.NextCursor
		if since, ok := parseConsoleTime(d.Since); ok {
			// Newest first: the first job older than since ends the listing.
			if i := slices.IndexFunc(d.Jobs, func(j jobView) bool { return j.CreatedAt < since.Unix() }); i >= 0 {
				d.Jobs, next = d.Jobs[:i], ""
			}
		}
		if next != "" {
			nq := url.Values{"after": {next}}
			for _, k := range []string{"since", "until", "batch", "tenant"} {
				if v := q.Get(k); v != "" {
					nq.Set(k, v)
				}
			}
			for _, st := range d.Selected {
				nq.Add("state", st)
			}
			d.NextURL = "/console/jobs?" + nq.Encode()
		}
	}
	s.page(w, r, u, "jobs", "Jobs", d, err)
}

type jobData struct {
	Job        jobView
	Attempts   []attemptView
	Audit      []auditView
	Reasons    json.RawMessage
	Result     string
	Candidate  *candidate // a REVIEW_REQUIRED job's withheld answer
	Review     bool       // it waits for a review
	Replay     bool       // it may be replayed
	Hooks      bool       // the gateway has webhooks: Deliveries is the job's
	Deliveries []deliveryView
}

// candidate is a withheld answer, for a reviewer: the answer's text (the
// assistant message's content) and the whole stored result.
type candidate struct {
	Answer string
	Result string
}

// candidateOf reads a REVIEW_REQUIRED job's withheld result through the
// API's operator-only read (GET /v1/jobs/{id}/result?candidate=true).
func (s *Server) candidateOf(r *http.Request, u consoleUser, id string) *candidate {
	status, b := s.consoleCall(r, u, http.MethodGet, "/v1/jobs/"+url.PathEscape(id)+"/result?candidate=true", nil)
	if status != http.StatusOK {
		return nil
	}
	c := &candidate{Result: prettyJSON(b)}
	if a, err := validate.Answer(b); err == nil {
		c.Answer = a
	}
	return c
}

func (s *Server) consoleJob(w http.ResponseWriter, r *http.Request, u consoleUser) {
	id := url.PathEscape(r.PathValue("id"))
	var d jobData
	err := s.consoleGet(r, u, "/v1/jobs/"+id, &d.Job)
	if err == nil {
		var as struct {
			Data []attemptView `json:"data"`
		}
		if err = s.consoleGet(r, u, "/v1/jobs/"+id+"/attempts", &as); err == nil {
			d.Attempts = as.Data
		}
	}
	if err == nil {
		var au struct {
			Data []auditView `json:"data"`
		}
		if err = s.consoleGet(r, u, "/v1/jobs/"+id+"/audit", &au); err == nil {
			d.Audit = au.Data
		}
	}
	if err == nil {
		d.Review = d.Job.State == string(store.ReviewRequired)
		d.Replay = d.Review || d.Job.State == string(store.FailedTerminal)
		if d.Job.State == string(store.Succeeded) {
			if status, b := s.consoleCall(r, u, http.MethodGet, "/v1/jobs/"+id+"/result", nil); status == http.StatusOK {
				d.Result = prettyJSON(b)
			}
		}
		if d.Review {
			d.Reasons = s.reviewReasons(r, u, d.Job.ID)
			d.Candidate = s.candidateOf(r, u, d.Job.ID)
		}
		if d.Hooks = u.hooks; d.Hooks {
			var pg struct {
				Data []deliveryView `json:"data"`
			}
			if err = s.consoleGet(r, u, "/v1/jobs/"+id+"/deliveries?limit=100", &pg); err == nil {
				d.Deliveries = pg.Data
			}
		}
	}
	title := "Job"
	if d.Job.ID != "" {
		title = "Job " + d.Job.ID
	}
	s.page(w, r, u, "job", title, d, err)
}

// reviewReasons reads a REVIEW_REQUIRED job's reasons.
func (s *Server) reviewReasons(r *http.Request, u consoleUser, id string) json.RawMessage {
	var v reviewView
	if s.consoleGet(r, u, "/v1/jobs/"+url.PathEscape(id)+"/review", &v) != nil {
		return nil
	}
	return v.Reasons
}

type reviewsData struct {
	Reviews    []reviewView
	Candidates map[string]*candidate // by job id: each one's withheld answer
	NextURL    string
}

func (s *Server) consoleReviews(w http.ResponseWriter, r *http.Request, u consoleUser) {
	var pg struct {
		Data       []reviewView `json:"data"`
		NextCursor string       `json:"next_cursor"`
	}
	err := s.consoleGet(r, u, "/v1/reviews?limit="+strconv.Itoa(consolePageSize)+"&after="+url.QueryEscape(r.URL.Query().Get("after")), &pg)
	d := reviewsData{Reviews: pg.Data, Candidates: map[string]*candidate{}}
	for _, v := range pg.Data {
		d.Candidates[v.ID] = s.candidateOf(r, u, v.ID)
	}
	if pg.NextCursor != "" {
		d.NextURL = "/console/reviews?" + keptQuery(r, url.Values{"after": {pg.NextCursor}}).Encode()
	}
	s.page(w, r, u, "reviews", "Reviews", d, err)
}

// consoleAction posts an action's API twin and goes back to where the
// form came from, with the API's answer as the notice.
func (s *Server) consoleAction(w http.ResponseWriter, r *http.Request, u consoleUser, path string, body any, done string) {
	s.consoleActionAs(w, r, u, http.MethodPost, path, body, done)
}

// consoleActionAs is consoleAction with another method (PATCH).
func (s *Server) consoleActionAs(w http.ResponseWriter, r *http.Request, u consoleUser, method, path string, body any, done string) {
	status, b := s.consoleCall(r, u, method, path, body)
	back := safeNext(r.PostFormValue("back"))
	msg := done
	if status >= 300 {
		msg = "Refused: " + apiMessage(status, b).Error()
	}
	sep := "?"
	if strings.Contains(back, "?") {
		sep = "&"
	}
	http.Redirect(w, r, back+sep+"notice="+url.QueryEscape(msg)+"&nsig="+noticeSig(u.sess.CSRF, msg), http.StatusSeeOther)
}

// noticeSig signs a notice with the session's CSRF token: a page shows
// only the notices the console itself put in a redirect, never text a
// link from elsewhere carries (?notice=Your key was rotated: get the new
// one at ...).
func noticeSig(csrf, msg string) string {
	m := hmac.New(sha256.New, []byte(csrf))
	m.Write([]byte(msg))
	return hex.EncodeToString(m.Sum(nil)[:16])
}

func (s *Server) consoleReview(w http.ResponseWriter, r *http.Request, u consoleUser) {
	req := reviewRequest{Decision: r.PostFormValue("decision"), Reason: r.PostFormValue("reason")}
	id := r.PathValue("id")
	s.consoleAction(w, r, u, "/v1/jobs/"+url.PathEscape(id)+"/review", req, "Job "+id+": "+reviewDone(req.Decision)+".")
}

// reviewDone is a review decision as done: approved, rejected.
// keptQuery is a next page's query: next, with the page's tenant (an
// admin reading another's) and the page's other keys named kept, so that
// paging one list neither changes tenant nor resets another list.
func keptQuery(r *http.Request, next url.Values, keep ...string) url.Values {
	q := r.URL.Query()
	for _, k := range append(keep, "tenant") {
		if v := q.Get(k); v != "" && next.Get(k) == "" {
			next.Set(k, v)
		}
	}
	return next
}

func reviewDone(decision string) string {
	switch decision {
	case "approve":
		return "approved"
	case "reject":
		return "rejected"
	}
	return decision // refused by the API: the notice says why
}

func (s *Server) consoleReplay(w http.ResponseWriter, r *http.Request, u consoleUser) {
	req := replayRequest{From: r.PostFormValue("from")}
	id := r.PathValue("id")
	s.consoleAction(w, r, u, "/v1/jobs/"+url.PathEscape(id)+"/replay", req, "Job "+id+" replayed.")
}

type deadLettersData struct {
	Letters []deadLetterView
	NextURL string
	Class   string
	Hooks   bool           // the gateway has webhooks: Failed is their dead letters
	Failed  []deliveryView // FAILED webhook deliveries, oldest first
	HookURL string         // their next page
}

func (s *Server) consoleDeadLetters(w http.ResponseWriter, r *http.Request, u consoleUser) {
	q := r.URL.Query()
	api := url.Values{"limit": {strconv.Itoa(consolePageSize)}}
	for _, k := range []string{"after", "class"} {
		if v := q.Get(k); v != "" {
			api.Set(k, v)
		}
	}
	var pg struct {
		Data       []deadLetterView `json:"data"`
		NextCursor string           `json:"next_cursor"`
	}
	err := s.consoleGet(r, u, "/v1/dead-letters?"+api.Encode(), &pg)
	d := deadLettersData{Letters: pg.Data, Class: q.Get("class"), Hooks: u.hooks}
	if pg.NextCursor != "" {
		d.NextURL = "/console/dead-letters?" + keptQuery(r, url.Values{"after": {pg.NextCursor}}, "class", "hooks_after").Encode()
	}
	if err == nil && d.Hooks {
		hq := url.Values{"kind": {"webhook_delivery"}, "limit": {strconv.Itoa(consolePageSize)}}
		if a := q.Get("hooks_after"); a != "" {
			hq.Set("after", a)
		}
		var hp struct {
			Data       []deliveryView `json:"data"`
			NextCursor string         `json:"next_cursor"`
		}
		if err = s.consoleGet(r, u, "/v1/dead-letters?"+hq.Encode(), &hp); err == nil {
			d.Failed = hp.Data
			if hp.NextCursor != "" {
				d.HookURL = "/console/dead-letters?" + keptQuery(r, url.Values{"hooks_after": {hp.NextCursor}}, "class", "after").Encode()
			}
		}
	}
	s.page(w, r, u, "deadletters", "Dead letters", d, err)
}

type tenantsData struct {
	Tenants []TenantView
	Keys    []KeyView
	NewKey  *KeyView // a rotated key, shown once
	// SessionEnded: the key rotated was the session's own.
	SessionEnded bool
	// The next pages of tenants and of keys, each keeping the other's.
	TenantsURL, KeysURL string
}

func (s *Server) consoleTenants(w http.ResponseWriter, r *http.Request, u consoleUser) {
	d, err := s.tenantsData(r, u)
	s.page(w, r, u, "tenants", "Tenants and keys", d, err)
}

// tenantsData reads a page of tenants (after ?tenants_after=) and one of
// keys (after ?keys_after=).
func (s *Server) tenantsData(r *http.Request, u consoleUser) (tenantsData, error) {
	var d tenantsData
	q := r.URL.Query()
	next := func(list, after string) string {
		v := url.Values{}
		for _, name := range []string{"tenants_after", "keys_after"} {
			if a := q.Get(name); a != "" {
				v.Set(name, a)
			}
		}
		v.Set(list+"_after", after)
		return "/console/tenants?" + v.Encode()
	}
	page := func(list string) string {
		v := url.Values{"limit": {strconv.Itoa(consolePageSize)}}
		if a := q.Get(list + "_after"); a != "" {
			v.Set("after", a)
		}
		return "/v1/admin/" + list + "?" + v.Encode()
	}
	var ts struct {
		Data    []TenantView `json:"data"`
		HasMore bool         `json:"has_more"`
		LastID  *string      `json:"last_id"`
	}
	if err := s.consoleGet(r, u, page("tenants"), &ts); err != nil {
		return d, err
	}
	var ks struct {
		Data    []KeyView `json:"data"`
		HasMore bool      `json:"has_more"`
		LastID  *string   `json:"last_id"`
	}
	if err := s.consoleGet(r, u, page("keys"), &ks); err != nil {
		return d, err
	}
	d.Tenants, d.Keys = ts.Data, ks.Data
	if ts.HasMore && ts.LastID != nil {
		d.TenantsURL = next("tenants", *ts.LastID)
	}
	if ks.HasMore && ks.LastID != nil {
		d.KeysURL = next("keys", *ks.LastID)
	}
	return d, nil
}

// consoleRotate rotates a key and shows the new one, once, on the page
// (never in a URL).
func (s *Server) consoleRotate(w http.ResponseWriter, r *http.Request, u consoleUser) {
	id := r.PathValue("id")
	status, b := s.consoleCall(r, u, http.MethodPost, "/v1/admin/keys/"+url.PathEscape(id)+"/rotate", nil)
	if status >= 300 {
		err := apiMessage(status, b)
		if status == http.StatusNotFound {
			// Most often the form posted again (a reload): the key was
			// rotated by the first post, whose page showed the new key
			// once; a second rotation cannot show it again.
			err = &consoleError{status: http.StatusNotFound, msg: fmt.Sprintf("Key %s is not a live key: if this page was reloaded after a rotation, the new key was shown on the page that rotation returned, once; if it was lost, rotate the new key (listed below) in turn.", id)}
		}
		d, _ := s.tenantsData(r, u)
		s.page(w, r, u, "tenants", "Tenants and keys", d, err)
		return
	}
	var k KeyView
	_ = json.Unmarshal(b, &k)
	if id == u.keyID {
		// The session's own key is revoked now: the session ends with it,
		// and the page shows the new key alone, to sign in again with.
		s.clearConsoleCookie(w, r, consoleCookie)
		s.page(w, r, u, "tenants", "Tenants and keys", tenantsData{NewKey: &k, SessionEnded: true}, nil)
		return
	}
	d, err := s.tenantsData(r, u)
	d.NewKey = &k
	s.page(w, r, u, "tenants", "Tenants and keys", d, err)
}

type usageData struct {
	Days   []UsageView
	Tenant string
}

func (s *Server) consoleUsage(w http.ResponseWriter, r *http.Request, u consoleUser) {
	var l struct {
		Data []UsageView `json:"data"`
	}
	path := "/v1/usage"
	tenant := r.URL.Query().Get("tenant")
	if u.Admin() {
		path = "/v1/admin/usage?tenant=" + url.QueryEscape(tenant)
	}
	err := s.consoleGet(r, u, path, &l)
	s.page(w, r, u, "usage", "Usage", usageData{Days: l.Data, Tenant: tenant}, err)
}

type batchesData struct {
	Batches []batchView
	NextURL string
}

func (s *Server) consoleBatches(w http.ResponseWriter, r *http.Request, u consoleUser) {
	var pg struct {
		Data    []batchView `json:"data"`
		HasMore bool        `json:"has_more"`
		LastID  *string     `json:"last_id"`
	}
	api := url.Values{"limit": {strconv.Itoa(consolePageSize)}}
	if a := r.URL.Query().Get("after"); a != "" {
		api.Set("after", a)
	}
	err := s.consoleGet(r, u, "/v1/batches?"+api.Encode(), &pg)
	d := batchesData{Batches: pg.Data}
	if pg.HasMore && pg.LastID != nil {
		d.NextURL = "/console/batches?" + keptQuery(r, url.Values{"after": {*pg.LastID}}).Encode()
	}
	s.page(w, r, u, "batches", "Batches", d, err)
}

func (s *Server) consoleCancelBatch(w http.ResponseWriter, r *http.Request, u consoleUser) {
	id := r.PathValue("id")
	s.consoleAction(w, r, u, "/v1/batches/"+url.PathEscape(id)+"/cancel", nil, "Batch "+id+" cancelling.")
}
