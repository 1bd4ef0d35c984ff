/*
 * raps_spank.c - thin SPANK shim of raps-slurm (all logic lives in Python).
 *
 * sbatch/salloc/srun (allocator, local context): the --raps and --raps-* options, strictly
 *   validated, exported with spank_job_control_setenv: PrologSlurmctld and Prolog see them
 *   as SPANK_RAPS_* (the batch script only as SLURM_SPANK_RAPS_*, in Slurm 22.05).
 * slurmstepd (remote context), for a --raps job: RAPS_ENABLED, the RAPS_* values and the
 *   plugstack.conf arguments agent_socket=PATH, coordinator=HOST:PORT[,...] (as
 *   RAPS_AGENT_SOCKET, RAPS_COORDINATOR) go into the env of the batch script and tasks.
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <slurm/spank.h>

/* Built with -fvisibility=hidden: what Slurm looks up is made visible here, and the
 * linker version script (raps_spank.map) has the last word. */
#define RAPS_EXPORT __attribute__((visibility("default")))

#pragma GCC visibility push(default)
SPANK_PLUGIN(raps, 1)
#pragma GCC visibility pop

enum { OPT_RAPS, OPT_SPARES, OPT_REPLICAS, OPT_CKPT, OPT_RPN, N_OPTS };

static const struct {
	const char *name, *env;
	long min, max;
} limits[N_OPTS] = {
	[OPT_RAPS] = { "raps", "RAPS_ENABLED", 1, 1 },
	[OPT_SPARES] = { "raps-spares", "RAPS_SPARES", 0, 64 },
	[OPT_REPLICAS] = { "raps-replicas", "RAPS_REPLICAS", 0, 8 },
	[OPT_CKPT] = { "raps-ckpt-interval", "RAPS_CKPT_INTERVAL", 1, 604800 },
	[OPT_RPN] = { "raps-ranks-per-node", "RAPS_RANKS_PER_NODE", 1, 1024 },
};

static int given[N_OPTS];                           /* option seen (given[OPT_RAPS]: --raps) */
static long value[N_OPTS] = { [OPT_RAPS] = 1, [OPT_RPN] = 1 };
static char agent_socket[108];                      /* sizeof(sun_path) */
static char coordinator[1024];
static int config_ok = 1;                           /* plugstack.conf arguments valid */

static int opt_cb(int val, const char *optarg, int remote);

static struct spank_option options[N_OPTS] = {
	{ "raps", NULL, "Run the job under RAPS (resilient ranks, spare nodes).", 0, OPT_RAPS, opt_cb },
	{ "raps-spares", "N", "RAPS: spare nodes among the job's nodes (0-64).", 1, OPT_SPARES, opt_cb },
	{ "raps-replicas", "N", "RAPS: checkpoint copies besides the primary (0-8).", 1,
	  OPT_REPLICAS, opt_cb },
	{ "raps-ckpt-interval", "SEC", "RAPS: seconds between checkpoints (1-604800).", 1,
	  OPT_CKPT, opt_cb },
	{ "raps-ranks-per-node", "N", "RAPS: ranks per node (1-1024, default 1).", 1, OPT_RPN, opt_cb },
};

/* A decimal integer in [min, max]: digits only (no sign, no blanks), no overflow. */
static int parse_long(const char *s, long min, long max, long *out)
{
	char *end;
	long v;

	if (!s || *s < '0' || *s > '9')
		return -1;
	errno = 0;
	v = strtol(s, &end, 10);
	if (errno || *end != '\0' || v < min || v > max)
		return -1;
	*out = v;
	return 0;
}

static int opt_cb(int val, const char *optarg, int remote)
{
	(void)remote;
	if (val < 0 || val >= N_OPTS)
		return -1;
	if (!config_ok) {
		slurm_error("raps: the plugin arguments in plugstack.conf are invalid (see above)");
		return -1;
	}
	if (val != OPT_RAPS &&
	    parse_long(optarg, limits[val].min, limits[val].max, &value[val]) < 0) {
		slurm_error("raps: --%s: expected an integer %ld-%ld, got '%s'", limits[val].name,
			    limits[val].min, limits[val].max, optarg ? optarg : "");
		return -1;
	}
	given[val] = 1;
	return 0;
}

/* HOST:PORT[,HOST:PORT...]: HOST a name or IPv4 address or [IPv6], PORT 1-65535. */
static int valid_coordinator(const char *s)
{
	char *end;
	size_t n;
	long port;

	for (;;) {
		if (*s == '[')
			n = 1 + strspn(s + 1, "0123456789abcdefABCDEF:.") + 1;
		else
			n = strspn(s, "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"
				   "0123456789.-_");
		if (n == 0 || (*s == '[' && (n < 4 || s[n - 1] != ']')) || s[n] != ':')
			return 0;
		s += n + 1;
		if (*s < '0' || *s > '9')
			return 0;
		errno = 0;
		port = strtol(s, &end, 10);
		if (errno || port < 1 || port > 65535)
			return 0;
		if (*end == '\0')
			return 1;
		if (*end != ',')
			return 0;
		s = end + 1;
	}
}

static int set_arg(char *dst, size_t size, const char *key, const char *v, int ok)
{
	if (*dst)
		slurm_error("raps: plugin argument %s given twice", key);
	else if (!ok || strlen(v) >= size)
		slurm_error("raps: plugin argument %s: invalid value '%s'", key, v);
	else
		return snprintf(dst, size, "%s", v) < 0 ? -1 : 0;
	return -1;
}

static int parse_plugin_args(int ac, char **av)
{
	int i, rc;

	for (i = 0; i < ac; i++) {
		if (!strncmp(av[i], "agent_socket=", 13))
			rc = set_arg(agent_socket, sizeof(agent_socket), "agent_socket", av[i] + 13,
				     av[i][13] == '/');
		else if (!strncmp(av[i], "coordinator=", 12))
			rc = set_arg(coordinator, sizeof(coordinator), "coordinator", av[i] + 12,
				     valid_coordinator(av[i] + 12));
		else {
			slurm_error("raps: unknown plugin argument '%s' (expected "
				    "agent_socket=/PATH or coordinator=HOST:PORT[,HOST:PORT...])", av[i]);
			rc = -1;
		}
		if (rc < 0)
			return -1;
	}
	return 0;
}

RAPS_EXPORT int slurm_spank_init(spank_t sp, int ac, char **av)
{
	int i;

	switch (spank_context()) {
	case S_CTX_ALLOCATOR:
	case S_CTX_LOCAL:
	case S_CTX_REMOTE:
		if (parse_plugin_args(ac, av) < 0) {
			config_ok = 0;
			return -1;
		}
		for (i = 0; i < N_OPTS; i++) {
			if (spank_option_register(sp, &options[i]) != ESPANK_SUCCESS) {
				slurm_error("raps: cannot register --%s", options[i].name);
				return -1;
			}
		}
		return 0;
	default: /* slurmd, job script: nothing to do */
		return 0;
	}
}

/* One variable into the job control env (submit side) or the step env (slurmstepd). */
static int put_env(spank_t sp, int remote, const char *name, const char *v)
{
	spank_err_t rc = remote ? spank_setenv(sp, name, v, 1)
				: spank_job_control_setenv(sp, name, v, 1);

	if (rc != ESPANK_SUCCESS)
		slurm_error("raps: cannot set %s: %s", name, spank_strerror(rc));
	return rc == ESPANK_SUCCESS ? 0 : -1;
}

/* RAPS_ENABLED, RAPS_RANKS_PER_NODE and the RAPS_* values given. */
static int export_options(spank_t sp, int remote)
{
	char buf[24];
	int i;

	for (i = 0; i < N_OPTS; i++) {
		snprintf(buf, sizeof(buf), "%ld", value[i]);
		if ((given[i] || i == OPT_RPN) && put_env(sp, remote, limits[i].env, buf) < 0)
			return -1;
	}
	return 0;
}

RAPS_EXPORT int slurm_spank_init_post_opt(spank_t sp, int ac, char **av)
{
	int i;

	(void)ac;
	(void)av;
	switch (spank_context()) {
	case S_CTX_ALLOCATOR:
	case S_CTX_LOCAL:
		for (i = OPT_RAPS + 1; i < N_OPTS; i++) {
			if (given[i] && !given[OPT_RAPS]) {
				slurm_error("raps: --%s needs --raps", limits[i].name);
				return -1;
			}
		}
		return given[OPT_RAPS] ? export_options(sp, 0) : 0;
	default:
		return 0;
	}
}

/*
 * slurmstepd, before the tasks fork. A --raps job: the option reaches every step (sbatch
 * forwards it to the batch step; an srun inside the job takes it from the batch env).
 * A step started without it but from a RAPS env (RAPS_ENABLED=1 inherited) keeps the
 * inherited RAPS_* values and gets the plugin arguments only.
 */
RAPS_EXPORT int slurm_spank_user_init(spank_t sp, int ac, char **av)
{
	char buf[8];
	int has_opt;

	(void)ac;
	(void)av;
	if (spank_context() != S_CTX_REMOTE || !config_ok)
		return 0;
	has_opt = spank_option_getopt(sp, &options[OPT_RAPS], NULL) == ESPANK_SUCCESS;
	if (!has_opt && (spank_getenv(sp, "RAPS_ENABLED", buf, sizeof(buf)) != ESPANK_SUCCESS ||
			 strcmp(buf, "1") != 0))
		return 0;
	if ((has_opt && export_options(sp, 1) < 0) ||
	    (*agent_socket && put_env(sp, 1, "RAPS_AGENT_SOCKET", agent_socket) < 0) ||
	    (*coordinator && put_env(sp, 1, "RAPS_COORDINATOR", coordinator) < 0))
		return -1;
	return 0;
}
