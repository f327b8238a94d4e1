package gateway

import (
	"bytes"
	"context"
	"crypto/aes"
	"crypto/cipher"
	"crypto/hmac"
	"crypto/rand"
	"crypto/sha256"
	"crypto/subtle"
	"embed"
	"encoding/base64"
	"encoding/json"
	"errors"
	"html/template"
	"io"
	"io/fs"
	"net/http"
	"net/url"
	pathpkg "path"
	"strconv"
	"strings"
	"time"

	"github.com/google/uuid"

	"github.com/kvgate/kvgate/store"
)

// The operator console (/console): server-rendered html/template pages and
// a little plain JavaScript, all embedded in the binary (console/).
//
// It lives in package gateway, beside the API, so that it can add no second
// authorization path: a session holds the API key it was opened with, and
// every page, action and browser call is an ordinary API request, with that
// key as its bearer token, served by the same mux, handlers, role checks,
// tenant scoping and audit records as any other client's. Pages call the
// API in process (consoleCall); the browser's script calls /console/api/...,
// which forwards to /v1/... likewise (EventSource cannot send a bearer
// token, so the session's cookie stands for it).
//
// Sessions. A session is a sealed cookie (AES-GCM, key from
// Config.ConsoleSecret) holding the key, an expiry and a CSRF token:
// nothing is kept on the server, so a session opened on one replica is good
// on every replica that shares the secret. Without a secret each replica
// draws its own at start: sessions are per replica and end at a restart.
// Each request re-authenticates the session's key, so a key revoked ends
// its sessions (within the key cache's TTL on other replicas), and a key
// whose role is user is refused. The cookie is HttpOnly, SameSite=Strict,
// Secure when the request came over TLS, and expires with the session.
// Every state-changing request (a form's POST, or the script's non-GET
// call) must carry the session's CSRF token.

//go:embed console
var consoleFS embed.FS

const (
	consoleCookie    = "kvgate_console"
	consolePreCookie = "kvgate_console_signin" // the sign-in form's CSRF token
	consoleTTL       = 8 * time.Hour
)

var consoleTemplates = template.Must(template.New("").Funcs(consoleFuncs).ParseFS(consoleFS, "console/*.html"))

// consoleFuncs are the functions the console's templates call.
var consoleFuncs = template.FuncMap{
	"unix": func(sec int64) string {
		if sec == 0 {
			return ""
		}
		return time.Unix(sec, 0).UTC().Format("2006-01-02 15:04:05Z")
	},
	"pct":           func(f float64) string { return strings.TrimSuffix(strings.TrimRight(fmtFloat(f*100), "0"), ".") + "%" },
	"json":          func(b json.RawMessage) string { return prettyJSON(b) },
	"has":           func(s []string, v string) bool { return containsString(s, v) },
	"redeliverable": redeliverable,
	"div":           func(a, b int64) int64 { return a / b },
	"secs":          func(f float64) string { return time.Duration(f * float64(time.Second)).Round(time.Second).String() },
	"ms":            func(ms int64) string { return (time.Duration(ms) * time.Millisecond).String() },
	// num prints a count or an amount kept as a float in full, never in
	// exponent form (html/template's %v writes 4.2e-05 and 1.234567e+06).
	"num": func(f float64) string { return strconv.FormatFloat(f, 'f', -1, 64) },
	"gib": func(b uint64) string { return strconv.FormatFloat(float64(b)/(1<<30), 'f', 1, 64) + " GiB" },
	// A form that creates something carries a key of its own, sent as the
	// call's Idempotency-Key (consoleCall): the form posted again (a
	// reload) makes nothing a second time.
	"formKey": func() string { return uuid.Must(uuid.NewV7()).String() },
}

// consoleSession is what the cookie seals.
type consoleSession struct {
	Key     string `json:"k"`
	Expires int64  `json:"e"`
	CSRF    string `json:"c"`
}

// consoleSealer seals and opens session cookies.
type consoleSealer struct{ aead cipher.AEAD }

func newConsoleSealer(secret string) *consoleSealer {
	var key [32]byte
	if secret == "" {
		_, _ = rand.Read(key[:])
	} else {
		key = sha256.Sum256([]byte("kvgate console session\x00" + secret))
	}
	b, _ := aes.NewCipher(key[:])
	aead, _ := cipher.NewGCM(b)
	return &consoleSealer{aead: aead}
}

func (c *consoleSealer) seal(s consoleSession) string {
	plain, _ := json.Marshal(s)
	nonce := make([]byte, c.aead.NonceSize())
	_, _ = rand.Read(nonce)
	return base64.RawURLEncoding.EncodeToString(c.aead.Seal(nonce, nonce, plain, []byte(consoleCookie)))
}

func (c *consoleSealer) open(v string, now time.Time) (consoleSession, bool) {
	raw, err := base64.RawURLEncoding.DecodeString(v)
	if err != nil || len(raw) < c.aead.NonceSize() {
		return consoleSession{}, false
	}
	plain, err := c.aead.Open(nil, raw[:c.aead.NonceSize()], raw[c.aead.NonceSize():], []byte(consoleCookie))
	if err != nil {
		return consoleSession{}, false
	}
	var s consoleSession
	if json.Unmarshal(plain, &s) != nil || s.Key == "" || now.Unix() >= s.Expires {
		return consoleSession{}, false
	}
	return s, true
}

func randomToken() string {
	var b [24]byte
	_, _ = rand.Read(b[:])
	return base64.RawURLEncoding.EncodeToString(b[:])
}

// consoleUser is a signed-in caller, as a page sees it.
type consoleUser struct {
	sess   consoleSession
	tenant string
	keyID  string // the session's key's ("" for a static key)
	role   store.Role
	hooks  bool
}

func (u consoleUser) Admin() bool    { return u.role == store.RoleAdmin }
func (u consoleUser) Tenant() string { return u.tenant }
func (u consoleUser) Role() string   { return string(u.role) }
func (u consoleUser) CSRF() string   { return u.sess.CSRF }

// Webhooks says whether the gateway has webhooks (the nav shows them).
func (u consoleUser) Webhooks() bool { return u.hooks }

func (s *Server) consoleRoutes() {
	s.mux.HandleFunc("GET /console", func(w http.ResponseWriter, r *http.Request) {
		http.Redirect(w, r, "/console/fleet", http.StatusSeeOther)
	})
	static, _ := fs.Sub(consoleFS, "console/static")
	s.mux.Handle("GET /console/static/", http.StripPrefix("/console/static/", consoleHeaders(http.FileServerFS(static))))
	s.mux.HandleFunc("GET /console/signin", s.consoleSignInPage)
	s.mux.HandleFunc("POST /console/signin", s.consoleSignIn)
	s.mux.HandleFunc("POST /console/signout", s.consoleSignOut)
	for path, h := range map[string]func(http.ResponseWriter, *http.Request, consoleUser){
		"GET /console/fleet":                               s.consoleFleet,
		"GET /console/queues":                              s.consoleQueues,
		"GET /console/jobs":                                s.consoleJobs,
		"GET /console/jobs/{id}":                           s.consoleJob,
		"GET /console/reviews":                             s.consoleReviews,
		"POST /console/jobs/{id}/review":                   s.consoleReview,
		"GET /console/dead-letters":                        s.consoleDeadLetters,
		"POST /console/jobs/{id}/replay":                   s.consoleReplay,
		"GET /console/batches":                             s.consoleBatches,
		"POST /console/batches/{id}/cancel":                s.consoleCancelBatch,
		"GET /console/tenants":                             s.consoleTenants,
		"POST /console/keys/{id}/rotate":                   s.consoleRotate,
		"GET /console/usage":                               s.consoleUsage,
		"GET /console/webhooks":                            s.consoleWebhooks,
		"POST /console/webhooks/endpoints":                 s.consoleCreateEndpoint,
		"GET /console/webhooks/endpoints/{id}":             s.consoleEndpoint,
		"POST /console/webhooks/endpoints/{id}/state":      s.consoleEndpointState,
		"POST /console/webhooks/endpoints/{id}/rotate":     s.consoleRotateSecret,
		"POST /console/webhooks/endpoints/{id}/test":       s.consoleTestEndpoint,
		"GET /console/webhooks/deliveries/{id}":            s.consoleDelivery,
		"POST /console/webhooks/deliveries/{id}/redeliver": s.consoleRedeliver,
		"GET /console/api/{path...}":                       s.consoleAPI,
		"POST /console/api/{path...}":                      s.consoleAPI,
		"PATCH /console/api/{path...}":                     s.consoleAPI,
		"DELETE /console/api/{path...}":                    s.consoleAPI,
	} {
		s.mux.HandleFunc(path, s.console(h))
	}
}

// consoleHeaders sets the console's security headers: no framing, no
// script or style from anywhere but the gateway.
func consoleHeaders(h http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Security-Policy", "default-src 'self'; frame-ancestors 'none'; base-uri 'none'; form-action 'self'")
		w.Header().Set("X-Frame-Options", "DENY")
		w.Header().Set("X-Content-Type-Options", "nosniff")
		w.Header().Set("Referrer-Policy", "same-origin")
		h.ServeHTTP(w, r)
	})
}

// console wraps a console handler: the session (else the sign-in page, or
// 401 for the script's calls), its key authenticated again as an operator
// or admin, and the CSRF token on every state-changing request.
func (s *Server) console(h func(http.ResponseWriter, *http.Request, consoleUser)) http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		consoleHeaders(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			api := strings.HasPrefix(r.URL.Path, "/console/api/")
			refuse := func(status int, msg string) {
				switch {
				case api:
					writeError(w, s.log, &apiError{status: status, typ: "invalid_request_error", code: "console_session", msg: msg})
				case r.Method != http.MethodGet:
					// A form posted after its session ended: the action is
					// lost, and the browser goes to sign in, then back to
					// the form's page (read from a body bounded as a
					// form's: nobody is signed in yet).
					http.Redirect(w, r, "/console/signin?next="+url.QueryEscape(formBack(w, r)), http.StatusSeeOther)
				default:
					http.Redirect(w, r, "/console/signin?next="+url.QueryEscape(r.URL.RequestURI()), http.StatusSeeOther)
				}
			}
			c, err := r.Cookie(consoleCookie)
			if err != nil {
				refuse(http.StatusUnauthorized, "Sign in to the console.")
				return
			}
			sess, ok := s.consoleSeal.open(c.Value, time.Now())
			if !ok {
				s.clearConsoleCookie(w, r, consoleCookie)
				refuse(http.StatusUnauthorized, "The console session has ended: sign in again.")
				return
			}
			p, err := s.authenticateToken(r, sess.Key)
			if errors.Is(err, errKeysUnavailable) {
				// The store, not the key: the session stands, and the
				// page says to retry (503 with Retry-After), as a page to
				// a browser.
				if api {
					writeError(w, s.log, err)
					return
				}
				back := safeNext(r.URL.RequestURI())
				if r.Method != http.MethodGet {
					back = formBack(w, r) // a form's action takes no GET
				}
				w.Header().Set("Retry-After", "1")
				s.render(w, http.StatusServiceUnavailable, "unavailable.html", signInPage{Next: back,
					Error: "The gateway cannot check keys right now (its store is out of reach): try again in a moment."})
				return
			}
			if err != nil || (p.role != store.RoleOperator && p.role != store.RoleAdmin) {
				s.clearConsoleCookie(w, r, consoleCookie)
				refuse(http.StatusUnauthorized, "The session's key no longer opens the console: sign in again.")
				return
			}
			if r.Method != http.MethodGet && r.Method != http.MethodHead {
				if !api {
					r.Body = http.MaxBytesReader(w, r.Body, 64<<10) // a form; the API bounds its own bodies
				}
				tok := r.Header.Get("X-CSRF-Token")
				if tok == "" {
					tok = r.PostFormValue("csrf")
				}
				if subtle.ConstantTimeCompare([]byte(tok), []byte(sess.CSRF)) != 1 {
					writeError(w, s.log, &apiError{status: http.StatusForbidden, typ: "invalid_request_error", code: "csrf_token",
						msg: "The request carries no valid CSRF token."})
					return
				}
			}
			h(w, r, consoleUser{sess: sess, tenant: p.tenant, keyID: p.keyID, role: p.role, hooks: s.cfg.Webhooks.Store != nil})
		})).ServeHTTP(w, r)
	}
}

// formBack is the console page a form came from (its back field), read
// from at most a form's 64 KiB of body, url-encoded forms only.
func formBack(w http.ResponseWriter, r *http.Request) string {
	if !strings.HasPrefix(r.Header.Get("Content-Type"), "application/x-www-form-urlencoded") {
		return safeNext("")
	}
	r.Body = http.MaxBytesReader(w, r.Body, 64<<10)
	return safeNext(r.PostFormValue("back"))
}

// authenticateToken authenticates token as a bearer token, as api does.
func (s *Server) authenticateToken(r *http.Request, token string) (principal, error) {
	r2 := r.Clone(r.Context())
	r2.Header = http.Header{"Authorization": {"Bearer " + token}}
	return s.authenticate(r2)
}

// setConsoleCookie sets one of the console's cookies until expires. The
// session's is SameSite=Lax, so that a link to a console page from a
// chat or an alert opens it signed in (no GET changes anything, and every
// other request carries the session's CSRF token); the sign-in form's is
// Strict.
func (s *Server) setConsoleCookie(w http.ResponseWriter, r *http.Request, name, value string, expires time.Time) {
	same := http.SameSiteStrictMode
	if name == consoleCookie {
		same = http.SameSiteLaxMode
	}
	http.SetCookie(w, &http.Cookie{Name: name, Value: value, Path: "/console", Expires: expires,
		MaxAge: max(1, int(time.Until(expires)/time.Second)), HttpOnly: true, Secure: s.secureCookies(r), SameSite: same})
}

func (s *Server) clearConsoleCookie(w http.ResponseWriter, r *http.Request, name string) {
	http.SetCookie(w, &http.Cookie{Name: name, Value: "", Path: "/console", MaxAge: -1,
		HttpOnly: true, Secure: s.secureCookies(r), SameSite: http.SameSiteStrictMode})
}

// secureCookies says whether the console's cookies are Secure: on
// kvgate's own HTTPS, and on every request where the configuration says
// a proxy ends TLS in front of it.
func (s *Server) secureCookies(r *http.Request) bool {
	return r.TLS != nil || s.cfg.ConsoleSecureCookies
}

// safeNext keeps a redirect after sign-in inside the console.
func safeNext(next string) string {
	if !strings.HasPrefix(next, "/console/") || strings.HasPrefix(next, "//") || strings.Contains(next, "\\") ||
		strings.HasPrefix(next, "/console/api/") {
		return "/console/fleet"
	}
	return next
}

type signInPage struct {
	CSRF, Next, Error string
}

func (s *Server) consoleSignInPage(w http.ResponseWriter, r *http.Request) {
	consoleHeaders(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		s.renderSignIn(w, r, http.StatusOK, "")
	})).ServeHTTP(w, r)
}

func (s *Server) renderSignIn(w http.ResponseWriter, r *http.Request, status int, msg string) {
	// The token the browser holds, if any, stays: sign-in forms open in
	// two tabs both work.
	tok := randomToken()
	if c, err := r.Cookie(consolePreCookie); err == nil && len(c.Value) == len(tok) {
		tok = c.Value
	}
	s.setConsoleCookie(w, r, consolePreCookie, tok, time.Now().Add(time.Hour))
	s.render(w, status, "signin.html", signInPage{CSRF: tok, Next: safeNext(r.FormValue("next")), Error: msg})
}

// consoleSignIn opens a session for an operator or admin key. The form's
// token must match the sign-in cookie's, so that another site cannot sign
// a browser in with a key of its own.
func (s *Server) consoleSignIn(w http.ResponseWriter, r *http.Request) {
	consoleHeaders(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		r.Body = http.MaxBytesReader(w, r.Body, 64<<10)
		pre, err := r.Cookie(consolePreCookie)
		if err != nil || subtle.ConstantTimeCompare([]byte(pre.Value), []byte(r.PostFormValue("csrf"))) != 1 {
			s.renderSignIn(w, r, http.StatusForbidden, "The sign-in form has expired: try again.")
			return
		}
		key := strings.TrimSpace(r.PostFormValue("key"))
		p, err := s.authenticateToken(r, key)
		switch {
		case errors.Is(err, errKeysUnavailable):
			s.renderSignIn(w, r, http.StatusServiceUnavailable, "The gateway cannot check keys right now: try again in a moment.")
			return
		case key == "" || err != nil:
			s.renderSignIn(w, r, http.StatusUnauthorized, "That key is not valid.")
			return
		case p.role != store.RoleOperator && p.role != store.RoleAdmin:
			s.renderSignIn(w, r, http.StatusForbidden, "The console needs an operator or admin key.")
			return
		}
		exp := time.Now().Add(s.consoleTTL())
		s.setConsoleCookie(w, r, consoleCookie, s.consoleSeal.seal(consoleSession{Key: key, Expires: exp.Unix(), CSRF: randomToken()}), exp)
		s.clearConsoleCookie(w, r, consolePreCookie)
		s.log.Info("console sign-in", "tenant", p.tenant, "role", p.role, "key_id", p.keyID)
		http.Redirect(w, r, safeNext(r.PostFormValue("next")), http.StatusSeeOther)
	})).ServeHTTP(w, r)
}

// consoleSignOut ends the browser's session whatever its key's state: a
// key store that cannot be reached, a key revoked since, a session past
// its expiry. The session's CSRF token is still asked for, so that
// another site cannot sign the browser out.
func (s *Server) consoleSignOut(w http.ResponseWriter, r *http.Request) {
	consoleHeaders(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		r.Body = http.MaxBytesReader(w, r.Body, 64<<10)
		// Without the cookie (none, or another site's post, which a Lax
		// cookie does not go with) there is nothing to clear, and nothing
		// is: another site cannot sign a browser out.
		if c, err := r.Cookie(consoleCookie); err == nil {
			if sess, ok := s.consoleSeal.open(c.Value, time.Now()); ok &&
				subtle.ConstantTimeCompare([]byte(r.PostFormValue("csrf")), []byte(sess.CSRF)) != 1 {
				writeError(w, s.log, &apiError{status: http.StatusForbidden, typ: "invalid_request_error", code: "csrf_token",
					msg: "The request carries no valid CSRF token."})
				return
			}
			s.clearConsoleCookie(w, r, consoleCookie)
		}
		http.Redirect(w, r, "/console/signin", http.StatusSeeOther)
	})).ServeHTTP(w, r)
}

func (s *Server) consoleTTL() time.Duration {
	if s.cfg.ConsoleSessionTTL > 0 {
		return s.cfg.ConsoleSessionTTL
	}
	return consoleTTL
}

// consoleAPI forwards the script's call to /v1/... as the session's key.
// The request keeps its context (a stream ends with the browser's
// connection) and loses its cookies.
func (s *Server) consoleAPI(w http.ResponseWriter, r *http.Request, u consoleUser) {
	path := pathpkg.Clean("/" + r.PathValue("path"))
	if !strings.HasPrefix(path, "/v1/") {
		writeError(w, s.log, &apiError{status: http.StatusNotFound, typ: "invalid_request_error",
			msg: "The console forwards /console/api/v1/... only."})
		return
	}
	// A stream the page opened ends with the session, not after it.
	ctx, cancel := context.WithDeadline(r.Context(), time.Unix(u.sess.Expires, 0))
	defer cancel()
	r2 := r.Clone(ctx)
	r2.URL = &url.URL{Path: path, RawQuery: r.URL.RawQuery}
	r2.RequestURI = r2.URL.RequestURI()
	r2.Header = r.Header.Clone()
	r2.Header.Del("Cookie")
	r2.Header.Del("X-CSRF-Token")
	r2.Header.Set("Authorization", "Bearer "+u.sess.Key)
	s.mux.ServeHTTP(w, r2)
}

// bufferWriter collects an in-process API call's answer.
type bufferWriter struct {
	h      http.Header
	status int
	buf    bytes.Buffer
}

func (b *bufferWriter) Header() http.Header { return b.h }
func (b *bufferWriter) WriteHeader(code int) {
	if b.status == 0 {
		b.status = code
	}
}
func (b *bufferWriter) Write(p []byte) (int, error) {
	if b.status == 0 {
		b.status = http.StatusOK
	}
	return b.buf.Write(p)
}

// consoleCall makes an API call in process as the session's key, through
// the mux: the same handler, checks and audit as over the network.
func (s *Server) consoleCall(r *http.Request, u consoleUser, method, path string, body any) (int, []byte) {
	if t := r.URL.Query().Get("tenant"); t != "" && u.Admin() && method == http.MethodGet && !strings.Contains(path, "tenant=") {
		// An admin's page for another tenant reads as it (readScope).
		sep := "?"
		if strings.Contains(path, "?") {
			sep = "&"
		}
		path += sep + "tenant=" + url.QueryEscape(t)
	}
	var rd io.Reader = http.NoBody
	if body != nil {
		b, _ := json.Marshal(body)
		rd = bytes.NewReader(b)
	}
	req, err := http.NewRequestWithContext(r.Context(), method, path, rd)
	if err != nil {
		return http.StatusBadRequest, nil
	}
	req.RemoteAddr = r.RemoteAddr
	req.Header.Set("Authorization", "Bearer "+u.sess.Key)
	req.Header.Set("Content-Type", "application/json")
	if k := r.PostFormValue("form_key"); k != "" && method != http.MethodGet {
		req.Header.Set("Idempotency-Key", "console:"+k)
	}
	if id := r.Header.Get("X-Request-Id"); id != "" {
		req.Header.Set("X-Request-Id", id)
	}
	bw := &bufferWriter{h: http.Header{}}
	s.mux.ServeHTTP(bw, req)
	return bw.status, bw.buf.Bytes()
}

// consoleGet calls a GET route and decodes its answer into v; an error is
// the API's own message.
func (s *Server) consoleGet(r *http.Request, u consoleUser, path string, v any) error {
	status, b := s.consoleCall(r, u, http.MethodGet, path, nil)
	if status != http.StatusOK {
		return apiMessage(status, b)
	}
	return json.Unmarshal(b, v)
}

// apiMessage is an API error's message, for a page to show.
func apiMessage(status int, b []byte) error {
	var eb struct {
		Error struct {
			Message string `json:"message"`
		} `json:"error"`
	}
	if json.Unmarshal(b, &eb) == nil && eb.Error.Message != "" {
		return &consoleError{status: status, msg: eb.Error.Message}
	}
	return &consoleError{status: status, msg: http.StatusText(status)}
}

type consoleError struct {
	status int
	msg    string
}

func (e *consoleError) Error() string { return e.msg }

func statusOf(err error) int {
	var ce *consoleError
	if errors.As(err, &ce) {
		return ce.status
	}
	return http.StatusInternalServerError
}

// page is what every page's template gets.
type consolePage struct {
	Title, Nav string
	User       consoleUser
	Error      string
	Notice     string
	Data       any
	// Foreign is the tenant whose page an admin reads (?tenant=): shown
	// read-only, since a change acts for the key's own tenant (readScope)
	// and would find nothing there.
	Foreign string
}

func (s *Server) render(w http.ResponseWriter, status int, name string, data any) {
	var buf bytes.Buffer
	if err := consoleTemplates.ExecuteTemplate(&buf, name, data); err != nil {
		s.log.Error("console template", "template", name, "err", err)
		http.Error(w, "console template failed", http.StatusInternalServerError)
		return
	}
	w.Header().Set("Content-Type", "text/html; charset=utf-8")
	w.Header().Set("Cache-Control", "no-store")
	w.WriteHeader(status)
	_, _ = w.Write(buf.Bytes())
}

// page renders a console page; err, when set, is shown in place of data
// with its API status.
func (s *Server) page(w http.ResponseWriter, r *http.Request, u consoleUser, nav, title string, data any, err error) {
	s.pageAs(w, r, u, nav, nav, title, data, err)
}

// pageAs renders template tmpl under nav's entry.
func (s *Server) pageAs(w http.ResponseWriter, r *http.Request, u consoleUser, nav, tmpl, title string, data any, err error) {
	p := consolePage{Title: title, Nav: nav, User: u, Data: data}
	if q := r.URL.Query(); hmac.Equal([]byte(q.Get("nsig")), []byte(noticeSig(u.sess.CSRF, q.Get("notice")))) {
		p.Notice = q.Get("notice")
	}
	if t := r.URL.Query().Get("tenant"); t != "" && t != u.tenant && u.Admin() {
		p.Foreign = t
	}
	status := http.StatusOK
	if err != nil {
		p.Error, status = err.Error(), statusOf(err)
	}
	s.render(w, status, tmpl+".html", p)
}
